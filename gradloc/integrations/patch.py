"""The one way gradloc installs itself into a framework: a class method wrapped so that gradloc attaches after it
(:func:`run_after`: verl's engine ``initialize``, OpenRLHF's trainer ``__init__``), and instance methods replaced
and put back exactly (:class:`Patches`: verl's engine methods, OpenRLHF's trainer and strategy methods)."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

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


def patched(obj: Any, name: str) -> bool:
    """Whether ``obj.<name>`` is one of gradloc's instance patches (:class:`Patches`)."""
    return bool(getattr(getattr(obj, "__dict__", {}).get(name), "_gradloc", False))


class Patches:
    """Methods of framework objects (an engine, a trainer, its strategy) replaced by gradloc's, on those instances
    only; :meth:`undo` puts back exactly what each instance had (its own attribute, or none: the class's method
    again). ``orig[name]``: the method each replacement wraps (bound, as it was before)."""

    def __init__(self, patches: Sequence[tuple[Any, str, Callable[..., Any]]]) -> None:
        for obj, name, _ in patches:
            if patched(obj, name):
                raise AttachError(f"{type(obj).__name__}.{name} already has gradloc hooks; detach() them first")
        self.orig: dict[str, Callable[..., Any]] = {name: getattr(obj, name) for obj, name, _ in patches}
        own = [getattr(obj, "__dict__", {}) for obj, _, _ in patches]
        self._saved = [(obj, name, name in d, d.get(name)) for (obj, name, _), d in zip(patches, own)]
        for obj, name, fn in patches:
            setattr(obj, name, _marked(getattr(obj, name), fn))

    def undo(self) -> None:
        for obj, name, had, value in self._saved:
            if not patched(obj, name):
                continue  # replaced again by someone else since: theirs stays
            if had:
                setattr(obj, name, value)
            else:
                delattr(obj, name)  # back to the class's method
        self._saved = []


def _marked(orig: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapped._gradloc = True  # type: ignore[attr-defined]
    return wrapped
