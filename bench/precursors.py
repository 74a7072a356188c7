"""``python -m bench precursors``: lead time of the drift detector's precursor findings (gradloc/detector/drift.py)
on instabilities that reproduce on this machine, and its false findings on their stable controls.

Each scenario (:func:`bench.precursors_runs.scenarios`) trains a small model with gradloc attached, the drift
detector on at its defaults, and keeps every step's loss, incidents and ``StepRecord.precursor_findings`` — the
findings come from the monitor itself, not from a replay (``--replay DIR --drift KEY=VALUE``
scores runs saved with ``--save DIR`` again under other detector settings: bench/precursors_replay.py; every run's
step records replayed at the live settings must make its live findings, checked as it ends). Scoring:

- *failure* of a run: the first grad-spike, divergence or non-finite incident after the drift detector's warm-up,
  or the step where the 100-step mean loss first exceeds 1.1 × its lowest value after the warm-up, whichever comes
  first (None: the run did not fail); a GRPO run's loss is not judged (a policy-gradient loss is no health measure);
- *failing layer*: the module whose statistic of the instability moved most toward its danger between the end of
  the warm-up and the failure, when it moved by ×2 at least (:data:`REPRODUCED_BY`: attention entropy halving for
  attention-logit growth, a router's entropy for a router collapse, the head's mean logsumexp² doubling for an
  output-logit divergence, the policy's mean token entropy — no module, named "" — for a GRPO entropy collapse); an
  instability run where none did is *not reproduced* (it may still fail otherwise) and is left out of the announced
  count;
- per instability run: for each statistic, its first finding before the failure, the lead time (failure − its
  step), the layer it named and whether that is the failing layer; the first paging finding likewise;
- per control run: findings and pages per 1,000 judged steps (after the warm-up, before its own failure), per
  statistic; a control that fails itself is not a stable run: its row says so and the bound leaves it out.

The target (issue 36): every instability announced ≥ 100 steps (or ≥ 20% of its healthy prefix) ahead, naming
the failing layer; ≤ 1 finding per 1,000 steps and no page on the controls. A statistic that misses the control
bound is listed in ``off_by_default``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from bench import precursors_replay as replaying
from bench.drift_rates import check_replay, control_rates
from bench.precursors_runs import Scenario, record_run, scenarios
from gradloc.config import DriftConfig
from gradloc.records.precursors import FALLING_STATISTICS

FAIL_KINDS = {"grad_spike", "divergence", "nonfinite_grad", "nonfinite_loss"}
LOSS_WINDOW, LOSS_RATIO = 100, 1.1


def failure(out: dict[str, Any], warmup: int) -> tuple[int | None, str]:
    """The run's failure step and what it was (see the module's docstring)."""
    inc = next((s for s, kinds in out["incidents"] if s >= warmup and FAIL_KINDS & set(kinds)), None)
    loss, best, blow = out["loss"], math.inf, None
    judged = range(warmup + LOSS_WINDOW, len(loss) + 1) if out.get("judge_loss", True) else ()  # RL: incidents only
    for s in judged:
        m = float(np.mean(loss[s - LOSS_WINDOW:s]))
        if not math.isfinite(m) or m > LOSS_RATIO * best:
            blow = s - 1
            break
        best = min(best, m)
    if inc is None and blow is None:
        return None, ""
    if blow is None or (inc is not None and inc <= blow):
        return inc, "incident"
    return blow, "loss"


# what "it reproduced" means per instability: the statistic that must have moved by at least ×2 (its log ratio
# ≥ ln 2) toward its danger from the warm-up's end to the failure, on some module — that module is the failing one
REPRODUCED_BY = {"attention_logit_growth": "attn_entropy", "router_collapse": "router_entropy",
                 "output_logit_divergence": "logit_lse_sq", "policy_entropy_collapse": "rl_entropy"}
MOVED = math.log(2.0)


def failing_layer(out: dict[str, Any], warmup: int, fail: int) -> str | None:
    """The module whose statistic of the instability (:data:`REPRODUCED_BY`: attention entropy, a router's entropy,
    the head's mean logsumexp²) moved most toward its danger (log ratio) from the warm-up's end to the failure, when
    it moved by at least ×2 (None: nothing did — the instability did not reproduce, whatever else failed)."""
    statistic = REPRODUCED_BY.get(out["instability"], "attn_entropy")
    sign = -1.0 if statistic in FALLING_STATISTICS else 1.0
    best, name = MOVED, None
    for key, v in out["series"].items():
        kind, layer, _ = key.split("|")
        if kind != statistic:
            continue
        a, b = np.nanmedian(v[max(0, warmup - 50):warmup]), np.nanmedian(v[max(0, fail - 50):fail])
        moved = sign * math.log(max(b, 1e-6) / max(a, 1e-6))
        if moved >= best:
            best, name = moved, layer
    return name


def _names(f: Any, layer: str | None, out: dict[str, Any]) -> bool:
    """Whether finding ``f`` names the failing module: its own, or — for an instability of the whole policy (no
    module: ``layer`` "") — the instability's own statistic."""
    if layer is None or f.layer != layer:
        return False
    return bool(layer) or f.statistic == REPRODUCED_BY.get(out["instability"])


def levels(out: dict[str, Any], warmup: int, fail: int | None) -> dict[str, list[float]]:
    """Each series' median over the 50 steps before the warm-up's end and before the failure (or the run's end):
    what moved, whether or not a finding said so."""
    end = fail if fail is not None else len(out["loss"])

    def median(x: np.ndarray) -> float | None:
        x = x[np.isfinite(x)]
        return round(float(np.median(x)), 4) if len(x) else None

    return {key: [median(v[max(0, warmup - 50):warmup]), median(v[max(0, end - 50):end])]
            for key, v in out["series"].items()}


def score(out: dict[str, Any], cfg: DriftConfig) -> dict[str, Any]:
    """One run's row: failure, findings per statistic, lead times (instability) or rates (control)."""
    steps = len(out["loss"])
    fail, how = failure(out, cfg.warmup)
    findings = [f for f in out["findings"] if fail is None or f.step < fail]
    row: dict[str, Any] = dict(scenario=out["scenario"], role=out["role"], instability=out["instability"],
                               detail=out["detail"], steps=steps, seconds=round(out["seconds"], 1),
                               failure=fail, failure_by=how,
                               findings=[dict(step=f.step, statistic=f.statistic, layer=f.layer, head=f.head,
                                              trend=str(f.trend), pages=f.pages, since=f.since_step,
                                              change=round(f.change, 3), z=round(f.z, 1),
                                              drivers=[(d.step, d.sample_id, d.position) for d in f.drivers[:3]])
                                         for f in out["findings"]],
                               levels=levels(out, cfg.warmup, fail),
                               failure_localization=next((x for x in out.get("located", ()) if x["step"] == fail),
                                                         None))
    if out["role"] == "control":
        row.update(control_rates(findings, (fail if fail is not None else steps) - cfg.warmup))
        return row
    layer = failing_layer(out, cfg.warmup, fail) if fail is not None else None
    first: dict[str, Any] = {}
    for f in findings:
        key = f.statistic + (" (page)" if f.pages else "")
        if key not in first:
            first[key] = dict(step=f.step, lead=fail - f.step if fail is not None else None, layer=f.layer,
                              head=f.head, trend=str(f.trend), names_failing_layer=_names(f, layer, out))
    healthy = (fail if fail is not None else steps) - cfg.warmup
    leads = [v["lead"] for v in first.values() if v["lead"] is not None]
    row.update(failing_layer=layer, reproduced=layer is not None, first_by_statistic=first,
               lead=max(leads) if leads else None, healthy_prefix=healthy,
               announced=bool(leads) and max(leads) >= min(100, 0.2 * healthy),
               announced_naming_layer=any(v["lead"] is not None and v["lead"] >= min(100, 0.2 * healthy)
                                          and v["names_failing_layer"] for v in first.values()))
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per statistic: lead times over the instabilities, findings per 1,000 steps over the stable controls (a
    control that fails itself is listed in ``unstable_controls`` and left out of the bound); which statistics miss
    the control bound (ship off by default)."""
    stats: dict[str, dict[str, Any]] = defaultdict(lambda: dict(leads={}, control_per_1000={}, control_pages=0))
    for r in rows:
        if r["role"] == "control" and r["failure"] is not None:
            continue  # not a stable run: it failed itself (its findings are in its row, not in the bound)
        if r["role"] == "control":
            for k, v in r["per_statistic"].items():
                stats[k]["control_per_1000"][r["scenario"]] = v["per_1000"]
                stats[k]["control_pages"] += v["pages"]
        else:
            for k, v in r["first_by_statistic"].items():
                if not k.endswith("(page)"):
                    stats[k]["leads"][r["scenario"]] = dict(lead=v["lead"], layer_ok=v["names_failing_layer"])
    off = sorted(k for k, v in stats.items()
                 if v["control_pages"] or any(x > 1.0 for x in v["control_per_1000"].values()))
    controls = [r for r in rows if r["role"] == "control" and r["failure"] is None]
    return dict(per_statistic=dict(stats), off_by_default=off,
                instabilities_announced=sum(r["announced"] for r in rows if r["role"] != "control" and r["reproduced"]),
                instabilities=sum(r["role"] != "control" and r["reproduced"] for r in rows),
                not_reproduced=[r["scenario"] for r in rows if r["role"] != "control" and not r["reproduced"]],
                unstable_controls=[r["scenario"] for r in rows if r["role"] == "control" and r["failure"] is not None],
                control_findings_per_1000_max=max((r["findings_per_1000"] for r in controls), default=None),
                control_pages=sum(r["pages"] for r in controls))


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
    to replay (not ``enabled`` or ``statistics``: the series judged stay the live run's)."""
    return dataclasses.replace(DriftConfig(), **typed_fields(DriftConfig(), pairs, "--drift",
                                                             frozenset({"enabled", "statistics"})))


def run(selected: Sequence[Scenario], progress: bool = False, save_to: str | None = None) -> dict[str, Any]:
    """Train and score each scenario (``save_to``: also save each run's record there, for ``--replay``)."""
    cfg = DriftConfig()
    rows, t0 = [], time.perf_counter()
    for i, sc in enumerate(selected):
        if progress:
            print(f"[{i + 1}/{len(selected)}] {sc.name}: {sc.detail}", file=sys.stderr, flush=True)
        out = record_run(sc)
        check_replay(out["records"], cfg, sc.name)  # so that --replay's scores are what runs would have had
        if save_to is not None:
            replaying.save(out, save_to)
        rows.append(score(out, cfg))
    return _result(rows, cfg, t0)


def rescore(outs: Sequence[dict[str, Any]], cfg: DriftConfig) -> dict[str, Any]:
    """Saved runs scored on the findings a drift detector under ``cfg`` makes on them (bench/precursors_replay.py)."""
    t0 = time.perf_counter()
    rows = [score(dict(out, findings=replaying.replay(out, cfg)), cfg) for out in outs]
    return dict(_result(rows, cfg, t0), replayed=True)


def _result(rows: list[dict[str, Any]], cfg: DriftConfig, t0: float) -> dict[str, Any]:
    return dict(date=time.strftime("%Y-%m-%d"), drift=dict(warmup=cfg.warmup, reference=cfg.reference,
                                                            window=cfg.window, z_threshold=cfg.z_threshold,
                                                            min_change=cfg.min_change, patience=cfg.patience),
                runs=rows, summary=summarize(rows), seconds=round(time.perf_counter() - t0, 1))


def format_table(res: dict[str, Any]) -> str:
    lines = [f"precursors ({res['date']}, {res['seconds']:.0f} s)"]
    for r in res["runs"]:
        fail = f"fails at {r['failure']} ({r['failure_by']})" if r["failure"] is not None else "does not fail"
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
                lines.append(f"  {k:<24} step {v['step']:>5}  lead {v['lead']}  {v['layer']} {v['trend']}"
                             f"{'  (failing layer)' if v['names_failing_layer'] else ''}")
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
