"""Marks every test under tests/system ``integration`` (select or skip them with ``-m``)."""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A conftest hook sees the whole session's items, so keep to the ones in this directory.
    for item in items:
        if Path(item.path).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)
