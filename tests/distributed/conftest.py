"""Multi-process tests: every one is marked ``distributed`` and launches its own processes (launch.py)."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/distributed/" in str(item.fspath):
            item.add_marker(pytest.mark.distributed)
