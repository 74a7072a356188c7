"""Data groups: how much of a step's data came from each source, tag and length bucket (:class:`GroupTokens`).

A spike or outlier count means little without the amount of data behind it: a source that contributes half the
tokens will hold half the culprits by chance. Each step therefore carries, per group of its samples, how many
samples and loss tokens it had (``StepRecord.groups``); the daemon sums them across ranks and steps, and
``gradloc-agent patterns`` divides culprits and outliers by them (flags per million tokens).

Groups are kinds of a sample's :class:`~gradloc.records.provenance.SampleInfo` and of what gradloc sees itself:
``source`` (the mixture component), ``tag`` (``key=value``), and ``length`` (the sample's loss tokens, in the
buckets of :data:`LENGTH_BUCKETS`). Their names are bounded: a source or tag is at most 64 characters and a step
has at most :data:`MAX_GROUPS` groups (more are dropped and counted: ``groups_dropped``).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gradloc.records.provenance import MAX_SOURCE, MAX_TAG

LENGTH_BUCKETS = (64, 256, 1024, 4096)  # a sample of n loss tokens falls in the first bucket whose bound is >= n
POSITION_BUCKETS = (16, 64, 256, 1024, 4096)  # a culprit's position in its sample, bucketed the same way
NO_SOURCE = "(none)"  # the source group of samples whose SampleInfo names none
MAX_GROUPS = 64  # groups one step may carry (sources + tags + length buckets)
MAX_GROUP_NAME = max(MAX_SOURCE, 2 * MAX_TAG + 1)


class GroupKind(StrEnum):
    SOURCE = "source"  # SampleInfo.source
    TAG = "tag"  # one of SampleInfo.tags, named "key=value"
    LENGTH = "length"  # the sample's loss tokens, bucketed (length_bucket)
    # derived from a culprit or outlier only (no per-step token count: shares, not rates)
    POSITION = "position"  # where in its sample the flagged span starts (position_bucket)
    TOKEN_CLASS = "token_class"  # what the flagged text is made of (token_class)
    RL_CLASS = "rl_class"  # an RL incident's classification (train_inference_mismatch, …)


STEP_KINDS = frozenset({GroupKind.SOURCE.value, GroupKind.TAG.value, GroupKind.LENGTH.value})  # counted per step


@dataclass(frozen=True, kw_only=True)
class GroupTokens:
    """One group's data in one step of one rank: its samples and their loss tokens (every position of a sample
    when no loss mask was given)."""

    kind: GroupKind
    name: str
    samples: int
    tokens: int

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"GroupTokens: kind must be one of {sorted(STEP_KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "kind", GroupKind(self.kind))
        problem = group_problem(self.name, self.samples, self.tokens)
        if problem:
            raise ValueError(f"GroupTokens: {problem}")


def group_problem(name: object, samples: object, tokens: object) -> str:
    """Why these fields are not a valid group ('' when they are): the one check, here and on the daemon's wire."""
    if not isinstance(name, str) or not name or len(name) > MAX_GROUP_NAME:
        return f"name must be a non-empty string of at most {MAX_GROUP_NAME} characters"
    for what, n in (("samples", samples), ("tokens", tokens)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return f"{what} must be an integer >= 0, got {n!r}"
    return ""


def length_bucket(tokens: int) -> str:
    """The length bucket of a sample of ``tokens`` loss tokens: "≤64", "≤256", … ">4096"."""
    return _bucket(tokens, LENGTH_BUCKETS)


def position_bucket(position: int) -> str:
    """The bucket of a position in its sample: "≤16", "≤64", … ">4096"."""
    return _bucket(position, POSITION_BUCKETS)


def _bucket(n: int, bounds: tuple[int, ...]) -> str:
    for bound in bounds:
        if n <= bound:
            return f"≤{bound}"
    return f">{bounds[-1]}"


def token_class(text: str | None) -> str:
    """What a flagged span's decoded text is made of: "special" (a <|…|> or <…> marker), "whitespace", "digits",
    "punctuation", "latin" (ASCII letters, with digits or punctuation), "other_script" (any letter outside ASCII),
    "unknown" (no text: no tokenizer)."""
    if not text:
        return "unknown"
    stripped = text.strip()
    if stripped.startswith("<") and stripped.endswith(">") and len(stripped) > 2:
        return "special"
    if not stripped:
        return "whitespace"
    if any(c.isalpha() and not c.isascii() for c in stripped):
        return "other_script"
    if all(c.isdigit() or c.isspace() for c in stripped):
        return "digits"
    if any(c.isalpha() for c in stripped):
        return "latin"
    return "punctuation"


__all__ = ["LENGTH_BUCKETS", "MAX_GROUPS", "MAX_GROUP_NAME", "NO_SOURCE", "POSITION_BUCKETS", "STEP_KINDS", "GroupKind",
           "GroupTokens", "group_problem", "length_bucket", "position_bucket", "token_class"]
