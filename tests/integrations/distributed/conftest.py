"""The integrations' multi-process tests (HF Trainer under DDP, Lightning's ``strategy="ddp"``, OpenRLHF on ZeRO
engines, verl on FSDP2): every one is marked ``distributed`` and launches its own processes
(tests/distributed/launch.py)."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/integrations/distributed/" in str(item.fspath):
            item.add_marker(pytest.mark.distributed)


from tests.distributed.conftest import ds_shm_op  # noqa: E402,F401  (DeepSpeed's shm op, built once per session)
