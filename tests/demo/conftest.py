"""The demo's tests: ``gradloc-agent demo`` starting the ranks of each backend itself (marked ``distributed``)."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/demo/test_demo_ranks.py" in str(item.fspath):
            item.add_marker(pytest.mark.distributed)


from tests.distributed.conftest import ds_shm_op  # noqa: E402,F401  (DeepSpeed's shm op, built once per session)
