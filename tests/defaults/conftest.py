"""The framework-defaults tier: each framework set up the way its own docs and examples set it up, with its
defaults left alone, around a Hugging Face model that has buffers. Every test here is marked ``defaults`` and
``distributed``. A new configuration that breaks gradloc must fail here, not in a
user's run (issue 32: ``DDP(model)`` with its default ``broadcast_buffers`` stalled every rank)."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/defaults/" in str(item.fspath):
            item.add_marker(pytest.mark.defaults)
            item.add_marker(pytest.mark.distributed)  # every test here launches a job (tests/distributed/launch.py)


from tests.distributed.conftest import ds_shm_op  # noqa: E402,F401  (DeepSpeed's shm op, built once per session)
