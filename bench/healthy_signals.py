"""What ``bench healthy``'s runs looked like to the default spike detector: a healthy run's extremes (how close it
came to an incident) and each injected fault kind's signal (how far its steps stood out). A trace is a
bench.healthy.Trace (its records, layers and faults), not imported: that module imports this one."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from gradloc.config import DetectorConfig
from gradloc.detector import SpikeDetector


def extremes(trace: Any) -> dict[str, Any]:
    """What the healthy run's steps looked like to the default detector: the largest global norm over
    its EMA mean, the largest z of the norm and its 99.9th percentile, the largest z of log(loss), the
    largest top-token share of a step whose norm was outside its band (z > z_threshold)."""
    det = SpikeDetector(DetectorConfig(), trace.layers)
    ratio, zs, loss_z, share = [], [], [], [0.0]
    for rec in trace.records:
        ev = det.observe(rec)
        if ev.mean is None:
            continue
        ratio.append(rec.global_norm / ev.mean)
        if ev.z is not None:
            zs.append(ev.z)
            if ev.z > det.config.z_threshold and rec.tokens is not None:
                share.append(rec.tokens.top_share)
        if ev.loss_z is not None:
            loss_z.append(ev.loss_z)
    top = sorted(range(len(ratio)), key=lambda i: -ratio[i])[:3]
    return {"norm_ratio_max": round(max(ratio), 3), "norm_ratio_top3": [round(ratio[i], 3) for i in top],
            "norm_z_max": round(max(zs), 2), "norm_z_q999": round(float(np.quantile(zs, 0.999)), 2),
            "steps_over_2_5_z": sum(z > 2.5 for z in zs), "loss_z_max": round(max(loss_z), 2),
            "top_share_max_out_of_band": round(max(share), 3)}


def fault_signals(traces: Sequence[Any]) -> dict[str, dict[str, list[float]]]:
    """Per fault kind, what its steps looked like to the default detector: [min, median, max] of the
    global norm over its EMA mean, of the z of log(loss) and of the top-token share."""
    seen: dict[str, dict[str, list[float]]] = {}
    for t in traces:
        at = {f.step: f.kind for f in t.faults}
        det = SpikeDetector(DetectorConfig(), t.layers)
        for rec in t.records:
            ev = det.observe(rec)
            if rec.step not in at or ev.mean is None:
                continue
            row = seen.setdefault(at[rec.step], {"norm_ratio": [], "loss_z": [], "top_share": []})
            row["norm_ratio"].append(rec.global_norm / ev.mean)
            if ev.loss_z is not None:
                row["loss_z"].append(ev.loss_z)
            if rec.tokens is not None:
                row["top_share"].append(rec.tokens.top_share)
    return {k: {name: [round(float(f(v)), 3) for f in (np.min, np.median, np.max)] if v else []
                for name, v in row.items()} for k, row in sorted(seen.items())}
