"""Typed setup errors.

Two regimes (docs/DESIGN-NOTES.md, "Errors"): wiring mistakes made at setup raise one of these with a message that
says what to change; anything on the training hot path logs, counts and drops instead.
"""


class GradlocError(Exception):
    """Base class for every error gradloc raises on purpose."""


class ConfigError(GradlocError, ValueError):
    """A config value is out of range or inconsistent."""


class AttachError(GradlocError, RuntimeError):
    """Attaching or detaching a monitor was done in the wrong order (e.g. attaching twice)."""


class UnsupportedModelError(GradlocError, TypeError):
    """The model cannot be watched as asked (e.g. no layer type has a per-token rule)."""


class BatchMetadataError(GradlocError, ValueError):
    """Token ids, masks or sample ids do not match the micro-batch the model saw."""


class ProbeError(GradlocError, RuntimeError):
    """A probe closure returned something that is not a scalar loss tensor requiring grad."""
