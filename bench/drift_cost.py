"""``python -m bench.drift_cost [--series N ...] [--steps N]``: the drift detector's host time per step
(gradloc/detector/drift.py) over N healthy log-normal series, median over the steps after its rings fill."""
from __future__ import annotations

import argparse
import json
import time
from typing import Sequence

import numpy as np

from gradloc.config import DriftConfig
from gradloc.detector.drift import DriftDetector, Observation


def ms_per_step(series: int, steps: int = 1200, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    cfg = DriftConfig(warmup=0)
    filled = cfg.reference_of("attn_max_logit") + cfg.window  # the series' values before it is judged
    if steps <= filled:
        raise ValueError(f"--steps must exceed {filled} (the series are judged from then on), got {steps}")
    det = DriftDetector(cfg)
    where = dict(job="cost", rank=0, time_unix=0.0)
    times = []
    for s in range(steps):
        obs = [Observation(statistic="attn_max_logit", layer=f"l{i}", value=float(np.exp(rng.normal(0.0, 0.05))))
               for i in range(series)]
        t0 = time.perf_counter()
        det.observe(s, obs, where)
        times.append(time.perf_counter() - t0)
    return round(1000.0 * float(np.median(times[filled:])), 3)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.drift_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--series", type=int, nargs="*", default=[16, 512])
    ap.add_argument("--steps", type=int, default=1200)
    a = ap.parse_args(argv)
    print(json.dumps({str(n): ms_per_step(n, a.steps) for n in a.series}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
