"""Scoring of ``bench/faults.py``'s runs: one fault step's row against what was planted (:func:`score`: ``p`` a
``faults.Planted``), the seeds' summary per fault kind and of the healthy run (:func:`summarize`: ``cfg`` a
``faults.FaultsConfig``), and its table (:func:`format_table`). The module docstring of ``bench/faults.py`` defines
every figure."""
from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

from bench.localization_summary import fmt

Cell = tuple[int, int]  # (micro-batch, sample)
LEVEL = {"repeated_tail": "span", "foreign_script": "sample", "random_ids": "sample", "shifted_labels_5": "sample",
         "duplicated_sample": "sample", "duplicated_document": "span", "truncated": "span", "planted_token": "token"}


def _named(loc: Any) -> tuple[set[Cell], dict[Cell, set[int]]]:
    """The samples and loss positions a located localization names (spans and token culprits)."""
    cells: set[Cell] = set()
    pos: dict[Cell, set[int]] = {}
    if loc is None or str(loc.status) != "located":
        return cells, pos
    for s in loc.spans:
        c = (s.micro_batch, s.sample)
        cells.add(c)
        pos.setdefault(c, set()).update(range(s.start, s.end))
    for k in loc.culprits:
        c = (k.micro_batch, k.sample)
        cells.add(c)
        pos.setdefault(c, set()).add(k.position)
    return cells, pos


def _micro_batch_named(loc: Any) -> int | None:
    """The micro-batch a ``micro_batch``-level localization names (its note says which), else None."""
    if loc is None or str(loc.level) != "micro_batch":
        return None
    m = re.search(r"micro-batch (\d+) carries it", loc.note)
    return int(m.group(1)) if m else -1


def score(p: Any, report: Any, aftershocks: list[int]) -> dict[str, Any]:
    """One fault step's row: detection, what the localization named against what was planted, outliers."""
    spike, inc, rec = report.spike, report.incident, report.record
    loc = inc.localization if inc is not None else None
    cells, pos = _named(loc)
    planted = set(p.cells)
    row: dict[str, Any] = {
        "fault": p.kind, "step": p.step, "level_planted": p.level, "planted": [list(c) for c in p.cells],
        "detail": p.detail, "detected": inc is not None, "kinds": list(spike.kinds),
        "z": None if spike.z is None else round(spike.z, 2),
        "norm_ratio": round(rec.global_norm / spike.mean, 3) if spike.mean else None,
        "loss_z": None if spike.loss_z is None else round(spike.loss_z, 2),
        "status": str(loc.status) if loc is not None else ("no incident" if inc is None else "not localized"),
        "level": str(loc.level) if loc is not None else "",
        "probes": loc.probes if loc is not None else 0, "passes": loc.passes if loc is not None else 0,
        "explained_share": None if loc is None or loc.explained_share is None else round(loc.explained_share, 4),
        "loss_share": None if loc is None or loc.loss_share is None else round(loc.loss_share, 4),
        "micro_batch_named": _micro_batch_named(loc),
        "named": [list(c) for c in sorted(cells)], "named_planted": len(cells & planted),
        "spans": [[x.micro_batch, x.sample, x.start, x.end, round(x.share, 4)] for x in loc.spans] if loc else [],
        "top_sample_share": None, "note": loc.note if loc is not None else "",
        "aftershocks": aftershocks,
    }
    if loc is not None and loc.samples:
        top = max(loc.samples, key=lambda s: s.share if s.share is not None else -1.0)
        row["top_sample"] = [top.micro_batch, top.sample]
        row["top_sample_share"] = None if top.share is None else round(top.share, 4)
    want = {(c, t) for c, ts in p.positions.items() for t in ts}
    got = {(c, t) for c, ts in pos.items() for t in ts}
    row.update(tokens_planted=len(want), tokens_named=len(got), tokens_hit=len(want & got),
               iou=round(len(want & got) / len(want | got), 4) if got else 0.0)
    out = {(o.micro_batch, o.sample): o for o in (rec.samples.outliers if rec.samples else ()) if o.kind == "surprise"}
    row["outlier_hits"] = sum(c in out for c in p.cells)
    row["outlier_z"] = [round(out[c].z, 1) for c in p.cells if c in out]
    row["outlier_others"] = (rec.samples.flagged if rec.samples else 0) - row["outlier_hits"]
    return row


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def _per_1000(n: int, d: int) -> float | None:
    return round(1000.0 * n / d, 3) if d else None


def summarize(cfg: Any, seeds: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [r for s in seeds for r in s["rows"]]
    per: dict[str, Any] = {}
    for kind in cfg.faults:
        rs = [r for r in rows if r["fault"] == kind]
        inc = [r for r in rs if r["detected"]]
        located = [r for r in inc if r["status"] == "located"]
        planted = sum(len(r["planted"]) for r in rs)
        hits = sum(r["named_planted"] for r in rs)
        named = sum(len(r["named"]) for r in located)
        d: dict[str, Any] = {
            "level": LEVEL[kind], "injected": len(rs), "detected": len(inc), "located": len(located),
            "status": dict(Counter(r["status"] for r in inc)), "levels": dict(Counter(r["level"] for r in located)),
            "kinds": dict(Counter(k for r in inc for k in r["kinds"])),
            "sample_recall": _ratio(hits, planted), "sample_recall_of_incidents": _ratio(
                sum(r["named_planted"] for r in inc), sum(len(r["planted"]) for r in inc)),
            "sample_precision": _ratio(sum(r["named_planted"] for r in located), named),
            "at_planted_level": sum(r["level"] == LEVEL[kind] for r in located),
            # located incidents that name none of the planted samples (another sample, or the wrong micro-batch)
            "wrong": sum(1 for r in located if not r["named_planted"] and not (
                r["level"] == "micro_batch" and r["micro_batch_named"] in {c[0] for c in r["planted"]})),
            "micro_batch_level": sum(r["level"] == "micro_batch" for r in located),
            "probes_median": statistics.median([r["probes"] for r in inc]) if inc else None,
            "probes_max": max((r["probes"] for r in inc), default=None),
            "passes_max": max((r["passes"] for r in inc), default=None),
            "outlier_hits": sum(r["outlier_hits"] for r in rs), "outlier_planted": planted,
            "outlier_others_at_fault_step": sum(r["outlier_others"] for r in rs),
            "aftershocks": sum(len(r["aftershocks"]) for r in rs),
            # positions: a sample fault's planted positions are all of its sample's
            "token_recall": _ratio(sum(r["tokens_hit"] for r in rs), sum(r["tokens_planted"] for r in rs)),
            "token_precision": _ratio(sum(r["tokens_hit"] for r in located), sum(r["tokens_named"] for r in located)),
            "iou_mean_located": round(statistics.mean(r["iou"] for r in located), 4) if located else None,
        }
        per[kind] = d
    h = [s["healthy"] for s in seeds]
    steps = sum(x["steps"] for x in h)
    n_inc = sum(len(x["incidents"]) for x in h)
    n_out = sum(x["outliers"] for x in h)
    judged = sum(x["judged"] for x in h)
    w_steps = sum(x["window_steps"] for x in h)
    return {
        "faults": per,
        "healthy": {"steps": steps, "false_incidents": n_inc, "false_incidents_per_1000_steps": _per_1000(n_inc, steps),
                    "false_outliers": n_out, "false_outliers_per_1000_steps": _per_1000(n_out, steps),
                    "judged_samples": judged, "false_outliers_per_1000_samples": _per_1000(n_out, judged),
                    "incidents": [{"seed": s["seed"], **i} for s in seeds for i in s["healthy"]["incidents"]],
                    "window_steps": w_steps, "window_incidents": sum(x["window_incidents"] for x in h),
                    "window_outliers": sum(x["window_outliers"] for x in h),
                    "early_steps": sum(x["early_steps"] for x in h),
                    "early_incidents": {str(s["seed"]): s["healthy"]["early_incidents"] for s in seeds},
                    "early_outliers": sum(x["early_outliers"] for x in h)},
        "rows": rows,
    }


def format_table(res: dict[str, Any]) -> str:
    head = ("fault", "level", "detected", "located", "levels", "wrong", "sample R", "sample P", "token R", "token P",
            "IoU", "probes med/max", "passes max", "outlier", "aftershocks")
    rows = [head]
    for kind, d in res["faults"].items():
        lv = ",".join(f"{k}:{v}" for k, v in sorted(d["levels"].items())) or "-"
        rows.append((kind, d["level"], f"{d['detected']}/{d['injected']}", str(d["located"]), lv, str(d["wrong"]),
                     fmt(d["sample_recall"]), fmt(d["sample_precision"]), fmt(d.get("token_recall")),
                     fmt(d.get("token_precision")), fmt(d.get("iou_mean_located")),
                     f"{fmt(d['probes_median'], 1)}/{fmt(d['probes_max'])}", fmt(d["passes_max"]),
                     f"{d['outlier_hits']}/{d['outlier_planted']}", str(d["aftershocks"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    h, s = res["healthy"], res["setup"]
    lines += ["", f"healthy steps {h['steps']} (from the end of the LR warm-up; {h['window_steps']} in the fault "
                  f"window, {h['window_incidents']} incidents, {h['window_outliers']} outliers there): "
                  f"false incidents {h['false_incidents']} "
                  f"({fmt(h['false_incidents_per_1000_steps'])} per 1,000 steps); false outliers {h['false_outliers']} "
                  f"({fmt(h['false_outliers_per_1000_steps'])} per 1,000 steps, "
                  f"{fmt(h['false_outliers_per_1000_samples'], 3)} per 1,000 of {h['judged_samples']} samples)"]
    lines.append(f"{s['family']} {s['params']:,} params, {s['micro_batches']} × ({s['batch']} × {s['seq']}) "
                 f"tokens/step, sensitivity {s['sensitivity']}; "
                 f"{s['seeds']} seeds × {s['steps']} steps (faults in [{s['pretrain']}, {s['steps'] - s['after']})); "
                 f"loss at step {s['pretrain']}: {', '.join(fmt(x['loss_at_pretrain'], 3) for x in res['runs'])}; "
                 f"total {res['wall_s']} s, load {res['loadavg_1m']}")
    return "\n".join(lines)


__all__ = ["Cell", "LEVEL", "format_table", "score", "summarize"]
