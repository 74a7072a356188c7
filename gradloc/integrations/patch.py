"""Install gradloc into a framework class by wrapping one of its methods (verl, OpenRLHF)."""
from __future__ import annotations

import functools
from typing import Any, Callable

from gradloc.errors import AttachError


def run_after(cls: type, name: str, after: Callable[[Any], None]) -> Callable[[], None]:
    """Wrap ``cls.<name>`` so that ``after(self)`` runs once the original returned; returns the
    uninstall function (which puts back exactly what was there, inherited or own)."""
    orig = cls.__dict__.get(name) or getattr(cls, name)
    if getattr(orig, "_gradloc", False):
        raise AttachError(f"gradloc is already installed on {cls.__name__}")

    @functools.wraps(orig)
    def patched(self: Any, *args: Any, **kw: Any) -> Any:
        out = orig(self, *args, **kw)
        after(self)
        return out

    patched._gradloc = True  # type: ignore[attr-defined]
    had = name in cls.__dict__
    setattr(cls, name, patched)

    def uninstall() -> None:
        if had:
            setattr(cls, name, orig)
        else:
            delattr(cls, name)

    return uninstall
