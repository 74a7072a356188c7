"""Multi-process tests: every one is marked ``distributed`` and launches its own processes (launch.py)."""
from __future__ import annotations

import contextlib
import os

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/distributed/" in str(item.fspath):
            item.add_marker(pytest.mark.distributed)


def _shm_leftovers() -> set[str]:
    """DeepSpeed's shm all-reduce buffers of this user (deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>)."""
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except OSError:
        return set()


@pytest.fixture(scope="session")
def ds_shm_op():
    """Build (or load) DeepSpeed's shm comm op in one process before any DeepSpeed launch, so no launch's
    deadline includes the JIT build (~45 s on an idle machine; 186 s measured here under load): seconds taken."""
    import subprocess
    import sys
    import time

    from tests.distributed.ds_common import ENV, HAS_DEEPSPEED

    if not HAS_DEEPSPEED:
        pytest.skip("needs the deepspeed extra")
    t0 = time.monotonic()
    code = "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None"
    before = _shm_leftovers()
    subprocess.run([sys.executable, "-c", code], env={**os.environ, **ENV}, check=True, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    yield time.monotonic() - t0
    for name in _shm_leftovers() - before:  # a rank killed at a deadline never unlinks its buffer
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", name))
