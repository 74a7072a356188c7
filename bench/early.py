"""Real runs from step 0: the healthy runs' own spikes, judged offline (issue 32's "from step 0" case).

``python -m bench healthy`` trains every family from initialisation with an LR warm-up and a cosine decay,
gradloc attached from step 0. Such runs spike on their own, mostly early (GPT-2's steps 41–66 in
docs/BENCHMARKS.md §5). The benchmark's headline counts every incident of a healthy run as false; this
module also says which of those incidents sit on a **real spike** and whether the real spikes were seen:

- a step's **level** is the median global norm of the ``window`` steps on either side of it (the step
  itself left out): an offline judge that sees the future, which the detector cannot;
- a **real spike** is a step whose norm is ≥ ``ratio`` (2.5, the default ``spike_ratio``) × its level;
- after the detector's warm-up, a real spike is **flagged** when the detector gives it an incident kind
  (an incident, or a step of an open incident's episode); inside the warm-up it is **reported** when the
  step carries ``warmup_spike`` (a finding; the warm-up opens no incident);
- an incident on a step that is not a real spike is **false on the strict count** too.

Both counts are printed: every incident of a healthy run (the headline, unchanged), and the incidents on
no real spike. Nothing here changes what the detector does.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from gradloc.config import DetectorConfig
from gradloc.detector import SpikeDetector, opens_incident
from gradloc.detector.detector import INCIDENT
from gradloc.records.steps import SpikeKind

RATIO = 2.5
WINDOW = 10


def levels(norms: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """Per step, the median of the norms of the ``window`` steps before and after it (itself left out)."""
    out = np.empty_like(norms)
    for i in range(len(norms)):
        around = np.concatenate([norms[max(0, i - window):i], norms[i + 1:i + 1 + window]])
        out[i] = np.median(around) if len(around) else norms[i]
    return out


def judge(records: list[Any], layers: list[str], det_cfg: DetectorConfig,
          ratio: float = RATIO, window: int = WINDOW) -> dict[str, Any]:
    """One healthy run through a detector with ``det_cfg``: its real spikes and what the detector did on them."""
    det = SpikeDetector(det_cfg, layers)
    norms = np.array([r.global_norm for r in records], dtype=np.float64)
    ratios = norms / np.maximum(levels(norms, window), 1e-30)
    warm = {"spikes": [], "reported": []}
    after = {"spikes": [], "flagged": []}
    incidents, on_spike = [], []
    for rec, r in zip(records, ratios):
        ev = det.observe(rec)
        spike = bool(np.isfinite(r) and r >= ratio)
        if opens_incident(ev):
            incidents.append(rec.step)
            if spike:
                on_spike.append(rec.step)
        if not spike:
            continue
        if ev.mean is None:  # the detector's warm-up: it opens no incident, it may report a warmup_spike
            warm["spikes"].append(rec.step)
            if SpikeKind.WARMUP_SPIKE in ev.kinds:
                warm["reported"].append(rec.step)
        else:
            after["spikes"].append(rec.step)
            if not INCIDENT.isdisjoint(ev.kinds):
                after["flagged"].append(rec.step)
    return {"real_spikes_after_warmup": after["spikes"], "flagged": after["flagged"],
            "warmup_spikes": warm["spikes"], "warmup_reported": warm["reported"],
            "incidents": len(incidents), "incidents_on_real_spikes": on_spike,
            "strict_false": len(incidents) - len(on_spike)}


def summarize(per_run: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """The setting's totals over its healthy runs."""
    def total(key: str) -> int:
        return sum(len(r[key]) for r in per_run)

    strict = sum(r["strict_false"] for r in per_run)
    spikes, warm = total("real_spikes_after_warmup"), total("warmup_spikes")
    return {"real_spikes_after_warmup": spikes, "flagged": total("flagged"),
            "flagged_share": round(total("flagged") / spikes, 3) if spikes else None,
            "warmup_spikes": warm, "warmup_reported": total("warmup_reported"),
            "incidents_on_real_spikes": total("incidents_on_real_spikes"),
            "strict_false": strict, "strict_false_per_1000": round(1000.0 * strict / steps, 2) if steps else 0.0,
            "ratio": RATIO, "window": WINDOW}
