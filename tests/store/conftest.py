"""The store tests that hold for both databases take ``target``: a fresh SQLite path, then a fresh
PostgreSQL database's URL (tests/postgres.py); the rest are about SQLite files and take ``tmp_path``."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.postgres import BACKENDS, store_target


@pytest.fixture(params=BACKENDS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    return store_target(request, tmp_path)
