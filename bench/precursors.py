"""``python -m bench precursors``: lead time of the drift detector's precursor findings (gradloc/detector/drift.py)
on instabilities that reproduce on this machine, and its false findings on their stable controls.

Each scenario (:func:`bench.precursors_runs.scenarios`) trains a small model with gradloc attached, the drift
detector on at its defaults, and keeps every step's loss, incidents and ``StepRecord.precursor_findings`` — the
findings come from the monitor itself, not from a replay (``--replay DIR --drift KEY=VALUE``
scores runs saved with ``--save DIR`` again under other detector settings: bench/precursors_replay.py; every run's
step records replayed at the live settings must make its live findings, checked as it ends). The scoring (failure,
failing layer, lead, control rates): bench/precursors_score.py.

The target (issue 36): every instability announced ≥ 100 steps (or ≥ 20% of its healthy prefix) ahead, naming
the failing layer; ≤ 1 finding per 1,000 steps and no page on the controls. A statistic that misses the control
bound is listed in ``off_by_default``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Sequence

from bench import precursors_replay as replaying
from bench.drift_rates import check_replay
from bench.precursors_runs import Scenario, record_run, scenarios
from bench.precursors_score import REPRODUCED_BY, score_all, summarize
from gradloc.config import DriftConfig


def with_overrides(sc: Scenario, pairs: Sequence[str]) -> Scenario:
    """``sc`` with its run's fields set from ``KEY=VALUE`` pairs (``--set``), each value read as the field's type
    (``tied``: true, false or none; ``none`` for any field that may be None, e.g. ``lr_end=none``: a constant LR); the
    detail says what was changed."""
    if not pairs:
        return sc
    changes = typed_fields(sc.run, pairs, "--set", frozenset({"family"}))
    return dataclasses.replace(sc, run=dataclasses.replace(sc.run, **changes),
                               detail=f"{sc.detail}; set {', '.join(pairs)}")


def typed_fields(obj: Any, pairs: Sequence[str], flag: str, fixed: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``KEY=VALUE`` pairs read as the dataclass ``obj``'s fields, each value as its field's type (``fixed``: fields
    not to be set; a tuple field cannot be)."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    changes: dict[str, Any] = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or key not in fields or key in fixed or isinstance(getattr(obj, key), tuple):
            raise ValueError(f"{flag} takes KEY=VALUE with KEY one of {sorted(k for k in fields if k not in fixed)}, "
                             f"got {pair!r}")
        now = getattr(obj, key)
        if text.lower() == "none" and "None" in str(fields[key].type):
            value: Any = None
        elif key == "tied" or now is None:
            value = {"true": True, "false": False, "none": None}.get(text.lower(), text)
            value = float(value) if isinstance(value, str) else value
        elif isinstance(now, bool):
            value = {"true": True, "false": False}[text.lower()]
        else:
            value = type(now)(text)
        changes[key] = value
    return changes


def drift_config(pairs: Sequence[str]) -> DriftConfig:
    """``--drift KEY=VALUE ...`` (``bench precursors --replay``, ``bench healthy``): the drift detector's settings
    to replay (not ``enabled`` or ``statistics``: the series judged stay the live run's). ``references`` takes
    ``STAT:STEPS,...`` (``references=none``: every statistic at ``reference``)."""
    own = [p for p in pairs if p.startswith("references=")]
    changes = typed_fields(DriftConfig(), [p for p in pairs if p not in own], "--drift",
                           frozenset({"enabled", "statistics"}))
    for pair in own:
        text = pair.partition("=")[2]
        try:
            changes["references"] = () if text.lower() in ("", "none") else tuple(
                (stat, int(steps)) for stat, _, steps in (item.partition(":") for item in text.split(",")))
        except ValueError:
            raise ValueError(f"--drift references takes STAT:STEPS,... (or none), got {pair!r}") from None
    return dataclasses.replace(DriftConfig(), **changes)


def run(selected: Sequence[Scenario], progress: bool = False, save_to: str | None = None) -> dict[str, Any]:
    """Train and score each scenario (``save_to``: also save each run's record there, for ``--replay``)."""
    cfg = DriftConfig()
    outs, t0 = [], time.perf_counter()
    for i, sc in enumerate(selected):
        if progress:
            print(f"[{i + 1}/{len(selected)}] {sc.name}: {sc.detail}", file=sys.stderr, flush=True)
        out = record_run(sc)
        check_replay(out["records"], cfg, sc.name)  # so that --replay's scores are what runs would have had
        if save_to is not None:
            replaying.save(out, save_to)
        outs.append({k: v for k, v in out.items() if k != "records"})  # the step records: large, scored without
    return _result(score_all(outs, cfg), cfg, t0)


def rescore(outs: Sequence[dict[str, Any]], cfg: DriftConfig) -> dict[str, Any]:
    """Saved runs scored on the findings a drift detector under ``cfg`` makes on them (bench/precursors_replay.py)."""
    t0 = time.perf_counter()
    rows = score_all([dict(out, findings=replaying.replay(out, cfg)) for out in outs], cfg)
    return dict(_result(rows, cfg, t0), replayed=True)


def _result(rows: list[dict[str, Any]], cfg: DriftConfig, t0: float) -> dict[str, Any]:
    return dict(date=time.strftime("%Y-%m-%d"), drift=dict(warmup=cfg.warmup, reference=cfg.reference,
                                                            window=cfg.window, z_threshold=cfg.z_threshold,
                                                            min_change=cfg.min_change, patience=cfg.patience,
                                                            references=dict(cfg.references)),
                runs=rows, summary=summarize(rows), seconds=round(time.perf_counter() - t0, 1))


def format_table(res: dict[str, Any]) -> str:
    lines = [f"precursors ({res['date']}, {res['seconds']:.0f} s)"]
    for r in res["runs"]:
        fail = f"fails at {r['failure']} ({r['failure_by']})" if r["failure"] is not None else "does not fail"
        if r.get("shared_with_control"):
            fail += f"; incidents its control shares (the data's, not counted): {r['shared_with_control']}"
        lines.append(f"\n{r['scenario']} [{r['role']}] {r['detail']}: {fail}")
        if r["role"] == "control":
            lines.append(f"  {r['findings_per_1000']} findings / 1,000 judged steps, {r['pages']} pages: "
                         + ", ".join(f"{k} {v['findings']}" for k, v in r["per_statistic"].items()))
        else:
            if not r["reproduced"]:
                moved = REPRODUCED_BY.get(r["instability"], "attn_entropy")
                lines.append(f"  NOT REPRODUCED: no module's {moved} moved ×2 toward its danger before the failure")
            named = "the policy (no module)" if r["failing_layer"] == "" else r["failing_layer"]
            lines.append(f"  failing layer {named}; announced {r['announced']} "
                         f"(naming it: {r['announced_naming_layer']})")
            for k, v in r["first_by_statistic"].items():
                later = (f"  (the failing layer named {v['failing_layer_lead']} ahead)"
                         if not v["names_failing_layer"] and v["failing_layer_lead"] is not None else "")
                lines.append(f"  {k:<24} step {v['step']:>5}  lead {v['lead']}  {v['layer']} {v['trend']}"
                             f"{'  (failing layer)' if v['names_failing_layer'] else ''}{later}")
    s = res["summary"]
    lines.append(f"\nannounced {s['instabilities_announced']}/{s['instabilities']} reproduced instabilities "
                 f"(not reproduced: {', '.join(s['not_reproduced']) or 'none'}); stable controls: max "
                 f"{s['control_findings_per_1000_max']} findings / 1,000 steps, {s['control_pages']} pages; "
                 f"off by default: {s['off_by_default'] or 'none'}; controls that failed themselves (not counted): "
                 f"{', '.join(s['unstable_controls']) or 'none'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench precursors", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000, help="steps per run (default 3000)")
    ap.add_argument("--only", nargs="*", default=None, help="scenario names (default: all)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--verbose", action="store_true", help="progress on stderr")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="change every chosen run's settings (bench/precursors_runs.RampConfig fields: lr_end, "
                         "experts, top_k, tied, z_loss, balance, balance_until, ...), to try a reproduction")
    ap.add_argument("--save", metavar="DIR", help="also save each run's record in DIR (for --replay)")
    ap.add_argument("--replay", metavar="DIR", help="score the runs saved in DIR again instead of training "
                    "(bench/precursors_replay.py), under --drift's settings")
    ap.add_argument("--drift", nargs="*", default=[], metavar="KEY=VALUE",
                    help="with --replay: the drift detector's settings (gradloc.config.DriftConfig fields: warmup, "
                         "reference, window, z_threshold, min_change, tau, patience, ...)")
    a = ap.parse_args(argv)
    if a.replay is not None or a.drift:
        if a.replay is None or a.save is not None or a.set:
            ap.error("--drift goes with --replay, which trains nothing (no --save or --set)")
        try:
            cfg = drift_config(a.drift)
            res = rescore(replaying.load(a.replay, a.only), cfg)
        except (ValueError, KeyError, FileNotFoundError) as e:  # a bad setting (ConfigError is a ValueError)
            ap.error(str(e))
        print(json.dumps(res, default=str) if a.json else format_table(res))
        return 0
    import torch

    torch.set_num_threads(1)
    chosen = [s for s in scenarios(a.steps) if a.only is None or s.name in a.only]
    if not chosen:
        ap.error(f"no scenario among {[s.name for s in scenarios(a.steps)]}")
    try:
        chosen = [with_overrides(s, a.set) for s in chosen]
    except (ValueError, KeyError) as e:
        ap.error(str(e))
    res = run(chosen, progress=a.verbose, save_to=a.save)
    print(json.dumps(res, default=str) if a.json else format_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
