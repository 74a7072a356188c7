"""Errors of the incident store (all :class:`~gradloc.errors.GradlocError`, so callers can catch one base)."""
from __future__ import annotations

from gradloc.errors import GradlocError


class StoreError(GradlocError, RuntimeError):
    """The incident store cannot be opened or used as asked (missing file, closed store, bad file)."""


class SchemaVersionError(StoreError):
    """The database was written by a newer gradloc: reading it could misread columns, so we refuse."""


class AmbiguousIdError(StoreError, LookupError):
    """An incident-id prefix matches more than one incident."""

    def __init__(self, prefix: str, matches: tuple[str, ...]) -> None:
        self.prefix, self.matches = prefix, matches
        shown = ", ".join(matches[:5]) + (", …" if len(matches) > 5 else "")
        super().__init__(f"incident id prefix {prefix!r} is ambiguous: it matches {shown}; give more characters")
