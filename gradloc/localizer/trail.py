"""What the levels below the tokens hand each other: a frozen trail of what was measured so far.

Each level (``below.py``: decomposition, sample/span, micro-batch, sample probes; ``ranks.py``: the rank) is a
function from the :class:`~gradloc.localizer.runner.Runner` (the probe budget and the collectives), a frozen
context and a :class:`Trail` to a result and the next trail — its notes, the passes beside the probes, the
samples measured and the ranks tried. No level keeps state of its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gradloc.localizer.diffuse import TOP_SAMPLES, describe
from gradloc.localizer.picture import merge_samples, top_samples
from gradloc.localizer.runner import Runner
from gradloc.records import Localization, Method, SampleShare, Status


@dataclass(frozen=True, kw_only=True)
class Trail:
    notes: tuple[str, ...] = ()
    passes: int = 0  # forward/backward passes beside the probes (decompositions, a rank's extra micro-batches)
    measured: tuple[SampleShare, ...] = ()  # samples whose share was measured (decomposed or probed)
    tried: frozenset[int] = frozenset()  # ranks measured as a whole (ranks.py)

    def note(self, text: str) -> "Trail":
        return replace(self, notes=(*self.notes, text))

    def passed(self, n: int) -> "Trail":
        return replace(self, passes=self.passes + n)

    @property
    def text(self) -> str:
        return "; ".join(self.notes)


def attributed(r: Runner) -> tuple[SampleShare, ...]:
    """The job's top samples by attribution score (one collective)."""
    every = r.comm.all_gather_object(top_samples(r.view), "gradloc top samples")
    return merge_samples(every, r.pic.total_score, not r.solo)


def record_samples(r: Runner, trail: Trail) -> tuple[SampleShare, ...]:
    """The job's top samples for the record: the measured ones first (their shares), then by attribution."""
    seen = {(s.rank, s.micro_batch, s.sample) for s in trail.measured}
    rest = [s for s in attributed(r) if (s.rank, s.micro_batch, s.sample) not in seen]
    measured = sorted(trail.measured, key=lambda s: -(s.share if s.share is not None and math.isfinite(s.share)
                                                      else -math.inf))
    return tuple(measured[:TOP_SAMPLES] + rest)[:TOP_SAMPLES]


def diffuse(r: Runner, n: int, trail: Trail) -> Localization:
    """Nothing below the tokens passed: ``diffuse``, with every measured share reported (``n``: the job's samples)."""
    samples = record_samples(r, trail)
    return r.record(method=Method.ATTRIBUTION, status=Status.DIFFUSE, probes=r.used, passes=trail.passes,
                    samples=samples, note=f"{trail.text}; {describe(samples, n)}")


__all__ = ["Trail", "attributed", "diffuse", "record_samples"]
