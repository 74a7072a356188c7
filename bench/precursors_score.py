"""The scoring of ``python -m bench precursors`` (bench/precursors.py) — a run's failure, its failing module, each
statistic's lead time, the controls' false findings:

- *failure* of a run: the first grad-spike, divergence or non-finite incident after the drift detector's warm-up,
  or the step where the 100-step mean loss first exceeds 1.1 × its lowest value after the warm-up, whichever comes
  first (None: the run did not fail); a GRPO run's loss is not judged (a policy-gradient loss is no health measure);
  an instability run's incident that one of its controls has too, at the same step on the same sample, is the data's
  (the batches depend only on the seed and the step) and is not its failure (:func:`shared_incidents`);
- *failing layer*: the module whose statistic of the instability moved most toward its danger between the end of
  the warm-up and the failure, when it moved by ×2 at least (:data:`REPRODUCED_BY`: attention entropy halving for
  attention-logit growth, a router's entropy for a router collapse, the head's mean logsumexp² doubling for an
  output-logit divergence, the policy's mean token entropy — no module, named "" — for a GRPO entropy collapse); an
  instability run where none did is *not reproduced* (it may still fail otherwise) and is left out of the announced
  count;
- per instability run: for each statistic, its first finding before the failure, the lead time (failure − its
  step), the layer it named and whether that is the failing layer, and the lead of its first finding that names the
  failing layer (two routers collapsing together are named in turn: the first may be the other one); the first
  paging finding likewise;
- per control run: findings and pages per 1,000 judged steps (after the warm-up, before its own failure), per
  statistic; a control that fails itself is not a stable run: its row says so and the bound leaves it out.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from bench.drift_rates import control_rates
from gradloc.config import DriftConfig
from gradloc.records.precursors import FALLING_STATISTICS

FAIL_KINDS = {"grad_spike", "divergence", "nonfinite_grad", "nonfinite_loss"}
LOSS_WINDOW, LOSS_RATIO = 100, 1.1


def failure(out: dict[str, Any], warmup: int, shared: Sequence[int] = ()) -> tuple[int | None, str]:
    """The run's failure step and what it was (see the module's docstring); incidents at ``shared`` steps (the data's,
    :func:`shared_incidents`) do not count."""
    inc = next((s for s, kinds in out["incidents"] if s >= warmup and s not in shared and FAIL_KINDS & set(kinds)),
               None)
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


def _incidents(out: dict[str, Any], warmup: int) -> dict[int, Any]:
    """The run's failure-kind incidents after the warm-up: step -> the sample id of its top culprit (None: none
    named)."""
    top = {x["step"]: (x["culprits"][0][3] if x["culprits"] else None) for x in out.get("located", ())}
    return {s: top.get(s) for s, kinds in out["incidents"] if s >= warmup and FAIL_KINDS & set(kinds)}


def shared_incidents(out: dict[str, Any], controls: Sequence[dict[str, Any]], warmup: int) -> list[int]:
    """The steps at which an instability run and one of its controls both have a failure-kind incident, naming the
    same sample where both name one: a run's batches depend only on the seed and the step (bench/natural.py), so a
    spike that a control — the same data, the stabilizer on; stable or not — shares at the same step on the same
    sample is the data's, not the instability's. Only between runs whose data is fixed that way (``data_by_step``; a GRPO run samples its own)."""
    if not out.get("data_by_step", False):
        return []
    mine = _incidents(out, warmup)
    shared = set()
    for c in controls:
        if not c.get("data_by_step", False):
            continue
        for s, sample in _incidents(c, warmup).items():
            if s in mine and (sample is None or mine[s] is None or sample == mine[s]):
                shared.add(s)
    return sorted(shared)


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


def score(out: dict[str, Any], cfg: DriftConfig, controls: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """One run's row: failure, findings per statistic, lead times (instability) or rates (control); an instability
    run's incidents that ``controls`` (its instability's control runs) share are not its failure."""
    steps = len(out["loss"])
    shared = shared_incidents(out, controls, cfg.warmup) if out["role"] != "control" else []
    fail, how = failure(out, cfg.warmup, shared)
    findings = [f for f in out["findings"] if fail is None or f.step < fail]
    row: dict[str, Any] = dict(scenario=out["scenario"], role=out["role"], instability=out["instability"],
                               detail=out["detail"], steps=steps, seconds=round(out["seconds"], 1),
                               failure=fail, failure_by=how, shared_with_control=shared,
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
                              head=f.head, trend=str(f.trend), names_failing_layer=_names(f, layer, out),
                              failing_layer_lead=None)
        if first[key]["failing_layer_lead"] is None and fail is not None and _names(f, layer, out):
            first[key]["failing_layer_lead"] = fail - f.step
    healthy = (fail if fail is not None else steps) - cfg.warmup
    leads = [v["lead"] for v in first.values() if v["lead"] is not None]
    row.update(failing_layer=layer, reproduced=layer is not None, first_by_statistic=first,
               lead=max(leads) if leads else None, healthy_prefix=healthy,
               announced=bool(leads) and max(leads) >= min(100, 0.2 * healthy),
               announced_naming_layer=any(v["failing_layer_lead"] is not None
                                          and v["failing_layer_lead"] >= min(100, 0.2 * healthy)
                                          for v in first.values()))
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
                    stats[k]["leads"][r["scenario"]] = dict(lead=v["lead"], layer_ok=v["names_failing_layer"],
                                                            failing_layer_lead=v["failing_layer_lead"])
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


def score_all(outs: Sequence[dict[str, Any]], cfg: DriftConfig) -> list[dict[str, Any]]:
    """Every run's row, each instability run beside the control runs of its instability among ``outs``."""
    controls: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for out in outs:
        if out["role"] == "control":
            controls[out["instability"]].append(out)
    return [score(out, cfg, controls.get(out["instability"], ())) for out in outs]
