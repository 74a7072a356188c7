"""Whether the running interpreter is the real-verl tier's (``.venv-verl``): verl is installed there only.

Checked through the installed distributions (``importlib.metadata``), not ``find_spec("verl")``, which would
answer for any ``verl`` directory importable from ``sys.path``.
"""
from __future__ import annotations

from importlib import metadata


def _has_verl() -> bool:
    try:
        metadata.distribution("verl")
        return True
    except metadata.PackageNotFoundError:
        return False


HAS_VERL = _has_verl()
