"""Where a sample came from: :class:`SampleInfo` (data provenance, and an RL rollout's request and spans), and the
one check of its provenance fields (where it is built, and on the daemon's wire)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gradloc.errors import BatchMetadataError

MAX_SOURCE = 64  # characters of SampleInfo.source (a mixture component's name)
MAX_ORIGIN = 512  # characters of SampleInfo.origin
MAX_TAGS = 8  # (key, value) pairs in SampleInfo.tags
MAX_TAG = 64  # characters of a tag's key or value


@dataclass(frozen=True)
class SampleInfo:
    """Where a sample came from: its data provenance, and for RL rollouts the request, the completion and its spans.

    Provenance (every field optional): ``source`` — the mixture component (a name from a small set: it may
    become a bounded metric label); ``origin`` — where the sample lives, whatever the loader knows ("file:row",
    "shard-00017.jsonl:4211", "doc 88123 @ byte 1024"); ``tags`` — a few (key, value) attributes (task, language,
    reward kind …; a mapping is accepted and kept sorted). Longer or more than the limits above raise
    :class:`~gradloc.errors.BatchMetadataError` when the SampleInfo is built: a clear error at the loader, never
    a silent cut.

    RL spans are in the coordinates gradloc reports positions in: *loss positions*, where position p
    scores token p + 1 of the sequence. The response's tokens are scored at positions
    [response_start, response_start + response_tokens); a culprit's response token index is
    ``position - response_start``.
    """

    request_id: str | None = None
    completion_index: int | None = None
    prompt_tokens: int = 0
    response_start: int = 0
    response_tokens: int = 0
    finish_reason: str | None = None
    source: str | None = None
    origin: str | None = None
    tags: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.tags, Mapping):
            object.__setattr__(self, "tags", tuple(sorted((str(k), str(v)) for k, v in self.tags.items())))
        problem = provenance_problem(self.source, self.origin, self.tags)
        if problem:
            raise BatchMetadataError(f"SampleInfo: {problem}")

    @property
    def provenance(self) -> str:
        """"source · origin" (what is known of them; "" when neither)."""
        return " · ".join(x for x in (self.source, self.origin) if x)


def provenance_problem(source: object, origin: object, tags: object) -> str:
    """Why these provenance fields are not valid ('' when they are): the one check, at construction and on the
    daemon's wire."""
    for name, value, limit in (("source", source, MAX_SOURCE), ("origin", origin, MAX_ORIGIN)):
        if value is not None and (not isinstance(value, str) or not value or len(value) > limit):
            return f"{name} must be a non-empty string of at most {limit} characters, got {_desc(value)}"
    if not isinstance(tags, tuple) or len(tags) > MAX_TAGS:
        return f"tags must be at most {MAX_TAGS} (key, value) pairs, got {_desc(tags)}"
    for pair in tags:
        if not (isinstance(pair, tuple) and len(pair) == 2
                and all(isinstance(x, str) and 0 < len(x) <= MAX_TAG for x in pair)):
            return f"each tag must be a (key, value) pair of non-empty strings of at most {MAX_TAG} characters, " \
                   f"got {_desc(pair)}"
    if len({k for k, _ in tags}) != len(tags):
        return f"tag keys must be distinct, got {[k for k, _ in tags]}"
    return ""


def _desc(value: object) -> str:
    if isinstance(value, str):
        return f"a string of {len(value)} characters" if len(value) > 40 else repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


__all__ = ["MAX_ORIGIN", "MAX_SOURCE", "MAX_TAG", "MAX_TAGS", "SampleInfo", "provenance_problem"]
