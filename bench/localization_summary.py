"""``bench/localization.py``'s results pooled (:func:`summarize`) and as a table (:func:`format_table`); :func:`fmt`
is the benches' one number format."""
from __future__ import annotations

import math
import statistics
from typing import Any


def fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}" if math.isfinite(x) else str(x)
    return str(x)


def ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(rows: list[dict[str, Any]], cfg: Any) -> dict[str, Any]:
    """The scenarios' rows pooled: gradloc's recall, precision and probes against both bisection baselines, overall
    and per scenario (``cfg``: the bench's ``LocalizationConfig``)."""
    planted = sum(len(r["planted"]) for r in rows)
    found = sum(r["gradloc"]["found"] for r in rows)
    reported = sum(len(r["gradloc"]["culprits"]) for r in rows)
    shares = [r["gradloc"]["explained_share"] for r in rows if r["gradloc"]["explained_share"] is not None]
    probes = [r["gradloc"]["probes"] for r in rows if r["detected"]]

    def base(key: str) -> dict[str, Any]:
        f = sum(r[key]["found"] for r in rows if r["detected"])  # undetected: no search would run
        rep = sum(len(r[key]["culprits"]) for r in rows if r["detected"])
        pr = [r[key]["probes"] for r in rows if r["detected"]]
        return {"recall": ratio(f, planted), "precision": ratio(f, rep), "probes_median": median(pr),
                "probes_max": max(pr) if pr else None}

    b, ba = base("bisection"), base("bisection_all")
    per_scenario = {}
    for name in cfg.scenarios:
        rs = [r for r in rows if r["scenario"] == name]
        n = sum(len(r["planted"]) for r in rs)
        per_scenario[name] = {
            "runs": len(rs), "detected": sum(r["detected"] for r in rs),
            "recall": ratio(sum(r["gradloc"]["found"] for r in rs), n),
            "precision": ratio(sum(r["gradloc"]["found"] for r in rs), sum(len(r["gradloc"]["culprits"]) for r in rs)),
            "probes_median": median([r["gradloc"]["probes"] for r in rs]),
            "bisection_recall": ratio(sum(r["bisection"]["found"] for r in rs if r["detected"]), n),
            "bisection_probes_median": median([r["bisection"]["probes"] for r in rs]),
            "bisection_all_recall": ratio(sum(r["bisection_all"]["found"] for r in rs if r["detected"]), n),
            "bisection_all_probes_median": median([r["bisection_all"]["probes"] for r in rs]),
            "probes_max": max((r["gradloc"]["probes"] for r in rs), default=None),
            "statuses": {st: sum(r["gradloc"]["status"] == st for r in rs) for st in {r["gradloc"]["status"] for r in rs}},
            "tokens_named": sum(len(r["gradloc"]["culprits"]) for r in rs),
            "bisection_tokens_named": sum(len(r["bisection"]["culprits"]) for r in rs if r["detected"]),
            "bisection_all_tokens_named": sum(len(r["bisection_all"]["culprits"]) for r in rs if r["detected"]),
        }
    return {
        "recall": ratio(found, planted),
        "precision": ratio(found, reported),
        "probes_max": max(probes) if probes else None,
        "probes_median": median(probes),
        "explained_share_min": round(min(shares), 4) if shares else None,
        "bisection_probes_median": b["probes_median"],
        "bisection_recall": b["recall"],
        "bisection_precision": b["precision"],
        "bisection_probes_max": b["probes_max"],
        "bisection_all_probes_median": ba["probes_median"],
        "bisection_all_recall": ba["recall"],
        "bisection_all_precision": ba["precision"],
        "bisection_all_probes_max": ba["probes_max"],
        "kappa": cfg.kappa,
        "spikes": sum(r["detected"] for r in rows),
        "runs": len(rows),
        "planted": planted,
        "per_scenario": per_scenario,
    }


def format_table(res: dict[str, Any]) -> str:
    rows = [("scenario", "seed", "kinds", "planted", "gradloc found/rep", "probes", "explained", "resid/healthy",
             "status", "bisect found/probes", "all-hot found/probes")]
    for r in res["scenarios"]:
        g = r["gradloc"]
        rows.append((r["scenario"], str(r["seed"]), ",".join(r["kinds"]) or "-", str(len(r["planted"])),
                     f"{g['found']}/{len(g['culprits'])}", str(g["probes"]), fmt(g["explained_share"]), fmt(g["residual_over_healthy"], 1), g["status"],
                     f"{r['bisection']['found']}/{r['bisection']['probes']}",
                     f"{r['bisection_all']['found']}/{r['bisection_all']['probes']}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    s = res["setup"]
    gl = (f"gradloc:                 recall {fmt(res['recall'])}  precision {fmt(res['precision'])}  "
          f"probes median {fmt(res['probes_median'])} max {fmt(res['probes_max'])}  "
          f"explained_share min {fmt(res['explained_share_min'])}")
    bw = (f"bisection (worst mb):    recall {fmt(res['bisection_recall'])}  "
          f"precision {fmt(res['bisection_precision'])}  "
          f"probes median {fmt(res['bisection_probes_median'])} max {fmt(res['bisection_probes_max'])}")
    ba = (f"bisection (all hot mbs): recall {fmt(res['bisection_all_recall'])}  "
          f"precision {fmt(res['bisection_all_precision'])}  probes median {fmt(res['bisection_all_probes_median'])} "
          f"max {fmt(res['bisection_all_probes_max'])}  (κ = {res['kappa']})")
    foot = (f"{res['spikes']}/{res['runs']} scenario steps flagged; {s['micro_batches']} × ({s['batch']} × {s['seq']}) "
            f"tokens/step, trained {s['train_steps']} steps to loss {s['final_loss']:.4f} in {s['train_s']} s; "
            f"total {res['wall_s']} s")
    lines += ["", gl, bw, ba, foot]
    return "\n".join(lines)


__all__ = ["fmt", "format_table", "median", "ratio", "summarize"]
