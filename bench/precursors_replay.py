"""``python -m bench precursors --save DIR`` / ``--replay DIR --drift KEY=VALUE ...``: the drift detector's
settings tried on runs already trained, without training them again.

``--save`` writes each run's record (bench/precursors_runs.record_run: every step's loss, incidents and precursor
series with where each extreme was) to ``DIR/<scenario>.pkl``; ``--replay`` reads them back and feeds a fresh
:class:`gradloc.detector.drift.DriftDetector` — under the settings ``--drift`` gives — every step's series values in
the order the monitor fed its own (the runs judge no update ratio: their series are every value the live detector
saw; drivers carry micro-batch, row and position, not the sample id, which only the live run knew). Its findings
replace the live ones and are scored as they are (bench/precursors.score). At the live run's own settings the
replay's findings are the live ones, step for step (tests/bench/test_precursors_replay.py): a setting's lead times
and control rates are what a run under it would have had — on these runs. A setting chosen on them still needs
the healthy runs of ``bench healthy`` (docs/BENCHMARKS.md §5) before it can become a default.
"""
from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any, Sequence

from gradloc.config import DriftConfig
from gradloc.detector.drift import DriftDetector, Observation
from gradloc.engine.drift import driver
from gradloc.records import PrecursorFinding


def save(out: dict[str, Any], directory: str | Path) -> Path:
    """One run's record (record_run's dict) as ``directory/<scenario>.pkl``."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    target = path / f"{out['scenario']}.pkl"
    with target.open("wb") as f:
        pickle.dump(out, f)
    return target


def load(directory: str | Path, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The runs saved in ``directory`` (only ``names``, when given), by scenario name."""
    paths = sorted(Path(directory).glob("*.pkl"))
    outs = []
    for p in paths:
        if names is None or p.stem in names:
            with p.open("rb") as f:  # bench files this machine wrote (--save): trusted input, not a service's
                outs.append(pickle.load(f))
    if not outs:
        raise FileNotFoundError(f"no saved run{'' if names is None else ' among ' + ', '.join(names)} in {directory}")
    return outs


def replay(out: dict[str, Any], cfg: DriftConfig) -> list[PrecursorFinding]:
    """The findings a drift detector under ``cfg`` makes on the run's series, step by step."""
    det = DriftDetector(cfg)
    keys = [(key, *key.split("|")) for key in out["series"]]  # "kind|layer|head"
    where = dict(job=out["scenario"], rank=0, time_unix=0.0)
    found: list[PrecursorFinding] = []
    for step in range(len(out["loss"])):
        obs = []
        for key, statistic, layer, head in keys:
            value = float(out["series"][key][step])
            if math.isfinite(value):
                obs.append(Observation(statistic=statistic, layer=layer, head=int(head) if head else None, value=value,
                                       driver=driver(step, value, out["at"][key][step], {})))
        found.extend(det.observe(step, obs, where))
    return found


__all__ = ["load", "replay", "save"]
