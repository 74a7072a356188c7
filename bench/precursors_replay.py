"""``python -m bench precursors --save DIR`` / ``--replay DIR --drift KEY=VALUE ...``: the drift detector's
settings tried on runs already trained, without training them again.

``--save`` writes each run's record (bench/precursors_runs.record_run: every step's loss, incidents, precursor
series and the monitor's own step records) to ``DIR/<scenario>.pkl``; ``--replay`` reads them back and judges the
step records again under the settings ``--drift`` gives, through the monitor's own drift path
(bench/drift_rates.replay, as ``bench healthy --drift`` does; drivers carry micro-batch, row and position, not the
sample id, which only the live run knew). Its findings replace the live ones and are scored as they are
(bench/precursors_score.score). At the live run's own settings the replay's findings are the live ones, step for step
(tests/bench/test_precursors_replay.py): a setting's lead times and control rates are what a run under it would
have had — on these runs. A setting chosen on them still needs the healthy runs of ``bench healthy --drift``
(docs/BENCHMARKS.md §5) before it can become a default.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Sequence

from bench.drift_rates import replay as replay_records
from gradloc.config import DriftConfig
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
                out = pickle.load(f)
            if "records" not in out:
                raise ValueError(f"{p} was saved without its step records (an older bench): train it again with --save")
            out.setdefault("data_by_step", out.get("judge_loss", True))  # saved before it was kept: GRPO's were not
            outs.append(out)
    if not outs:
        raise FileNotFoundError(f"no saved run{'' if names is None else ' among ' + ', '.join(names)} in {directory}")
    return outs


def replay(out: dict[str, Any], cfg: DriftConfig) -> list[PrecursorFinding]:
    """The findings a drift detector under ``cfg`` makes on the run's step records."""
    return replay_records(out["records"], cfg)


__all__ = ["load", "replay", "save"]
