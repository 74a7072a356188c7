"""Quarantine by policy: which samples the daemon puts on the quarantine list by itself (``CoreConfig.quarantine``).

- ``culprits``: every sample a *located* incident names at the token, span or sample level (its origin when its
  loader gave one, else its sample id) — a micro-batch, rank or diffuse finding names no sample to keep out;
- ``outlier_z``: every per-sample surprise outlier whose z reaches it.

Each entry records the incident (or the step) that put it there, so an incident says which samples it
quarantined (``IncidentStore.quarantine.list(incident_id=...)``, shown on its page).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gradloc.errors import ConfigError
from gradloc.records import QuarantineEntry, SampleInfo
from gradloc.reports import CorrelatedIncident, StepSummary

SAMPLE_LEVELS = ("token", "span", "sample")


@dataclass(frozen=True, kw_only=True)
class QuarantinePolicy:
    culprits: bool = False
    outlier_z: float | None = None

    def __post_init__(self) -> None:
        if self.outlier_z is not None and not self.outlier_z > 0:
            raise ConfigError(f"quarantine outlier_z must be > 0, got {self.outlier_z}")

    @property
    def active(self) -> bool:
        return self.culprits or self.outlier_z is not None


def _key(sample_id: str | None, info: SampleInfo | None) -> tuple[str, str] | None:
    if info is not None and info.origin:
        return "origin", info.origin
    return ("sample", sample_id) if sample_id else None


def incident_entries(policy: QuarantinePolicy, inc: CorrelatedIncident, now: float) -> list[QuarantineEntry]:
    """The samples ``inc`` names that the policy keeps out of the next run (one entry per sample)."""
    if not policy.culprits:
        return []
    out: dict[tuple[str, str], QuarantineEntry] = {}
    for f in inc.findings:
        loc = f.localization
        if loc is None or loc.status != "located" or loc.level not in SAMPLE_LEVELS:
            continue
        for s in loc.spans:
            key = _key(s.sample_id, s.sample_info)
            if key is not None and key not in out:
                out[key] = QuarantineEntry(kind=key[0], value=key[1], added_unix=now, job=inc.job, step=inc.step,
                                           incident_id=inc.incident_id,
                                           reason=f"{loc.level}-level culprit of incident {inc.incident_id[:12]} "
                                                  f"(step {inc.step}, {s.share:.0%} of ‖∇‖²)")
    return list(out.values())


def outlier_entries(policy: QuarantinePolicy, steps: Sequence[StepSummary], now: float) -> list[QuarantineEntry]:
    """The per-sample outliers of ``steps`` at or above the policy's z."""
    if policy.outlier_z is None:
        return []
    return list({(e.kind, e.value): e for e in _outliers(policy.outlier_z, steps, now)}.values())


def _outliers(z: float, steps: Sequence[StepSummary], now: float) -> Iterator[QuarantineEntry]:
    for s in steps:
        for o in s.samples.outliers if s.samples is not None else ():
            key = _key(o.sample_id, o.sample_info) if o.kind == "surprise" and o.z >= z else None
            if key is not None:
                yield QuarantineEntry(kind=key[0], value=key[1], added_unix=now, job=o.job, step=o.step,
                                      reason=f"surprise outlier at step {o.step} (z {o.z:.1f} ≥ {z:g})")


__all__ = ["QuarantinePolicy", "incident_entries", "outlier_entries"]
