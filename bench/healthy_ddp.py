"""``python -m bench healthy --ddp N``: the healthy runs of ``bench healthy`` as N-rank DDP jobs.

Each rank trains the same family (``bench/natural.py``) wrapped in ``DistributedDataParallel`` with its defaults
(buffers broadcast, gradients all-reduced at every backward), gradloc watching the wrapped model at its defaults,
each rank on its own data (seed + rank). Nothing is planted: every incident is false, and so is every precursor
finding of the drift detector, which judges the *job's* values (every rank's micro-batches: collector/precursors/
job.py). What the job shows: per rank its live incidents and findings (per 1,000 judged steps, pages,
``bench/drift_rates.py``), and whether the ranks agree — the same job-wide precursor values at every step after
the first (a rank's own values there: ``precursors_own_values``), the same incidents and the same findings.
``drift``: other drift settings, replayed over rank 0's step records (bench/drift_rates.replay: every finding of the
job, whichever rank would report it), after checking that a replay at the live defaults makes the job's live
findings.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from bench.drift_rates import key, pooled, replay, replay_rates, run_rates
from bench.natural import RunConfig

if TYPE_CHECKING:
    from gradloc.config import DriftConfig


def _rank(rank: int, world: int, cfg: RunConfig, drift: DriftConfig | None = None) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from bench.natural import Run
    from gradloc.config import DriftConfig

    torch.set_num_threads(1)
    run = Run(replace(cfg, seed=cfg.seed + rank), wrap=DistributedDataParallel,  # its own data; DDP syncs weights
              job=f"natural-ddp-{cfg.family}-{cfg.seed}")  # one job name on every rank
    values, incidents, records = [], [], []
    start = time.perf_counter()
    try:
        for _ in range(cfg.steps):
            rep = run.step()
            rec = rep.record
            values.append(tuple((str(p.kind), p.layer, p.head, p.value) for p in rec.precursors))
            records.append(rec)
            if rep.incident is not None:
                incidents.append((rec.step, sorted(str(k) for k in rep.incident.spike.kinds)))
        counters = {k: v for k, v in run.mon.counters.items() if v and ("precursor" in k or "drift" in k)}
    finally:
        run.close()
    rates = run_rates(records, DriftConfig().warmup)
    out = {}
    if drift is not None and rank == 0:  # the job's findings (every rank's), to check against the ranks' live ones
        out = {"replayed_live": sorted(map(key, replay(records, DriftConfig()))),
               "replayed": replay_rates(records, drift)}
    return {**out, "live": [key(f) for r in records for f in r.precursor_findings],
            "rank": rank, "values": values, "incidents": incidents, "precursors": rates, "counters": counters,
            "final_loss": round(float(records[-1].loss), 4), "job_kind": run.mon.job.kind,
            "wall_s": round(time.perf_counter() - start, 1)}


def run_healthy_ddp(cfg: RunConfig, families: tuple[str, ...], seeds: int, world: int,
                    timeout_s: float = 7200.0, drift: DriftConfig | None = None) -> dict[str, Any]:
    """One ``world``-rank DDP job per family × seed; each job's ranks and whether they agree (``drift``: and the
    job's findings under those settings, replayed)."""
    from gradloc.demo.spawn import TRAINING_PRELOAD, run_ranks

    start, jobs = time.perf_counter(), []
    for family in families:
        for seed in range(seeds):
            ranks = run_ranks(_rank, world, replace(cfg, family=family, seed=seed * world), drift,
                              timeout_s=timeout_s, paths=(os.getcwd(),), preload=TRAINING_PRELOAD)
            first = ranks[0]
            if drift is not None:
                live = sorted(k for r in ranks for k in r["live"])  # each finding reported by one rank
                if first["replayed_live"] != live:
                    raise AssertionError(f"{family} seed {seed}: the drift replay at the defaults "
                                         f"{first['replayed_live'][:5]} is not the job's live findings {live[:5]}")
            jobs.append({"family": family, "seed": seed, "steps": cfg.steps, "job_kind": first["job_kind"],
                         "values_agree_after_step_0": all(r["values"][1:] == first["values"][1:] for r in ranks),
                         "incidents_agree": all(r["incidents"] == first["incidents"] for r in ranks),
                         "findings_agree": all(r["precursors"]["at"] == first["precursors"]["at"] for r in ranks),
                         "series": len(first["values"][-1]),
                         "ranks": [{k: r[k] for k in ("rank", "incidents", "precursors", "counters", "final_loss",
                                                      "wall_s")} for r in ranks],
                         **({} if drift is None else {"replayed": first["replayed"]})})
    return {"world_size": world, "jobs": jobs,
            "precursors": pooled([j["ranks"][0]["precursors"] for j in jobs]),  # the job's: rank 0 reports it
            "false_incidents": sum(len(j["ranks"][0]["incidents"]) for j in jobs),
            **({} if drift is None else {"drift_replayed": dict(settings=asdict(drift), **pooled(
                [j["replayed"] for j in jobs]))}),
            "setup": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "micro_batches": cfg.micro_batches,
                      "batch": cfg.batch, "seq": cfg.seq, "steps": cfg.steps},
            "wall_s": round(time.perf_counter() - start, 1)}


def format_ddp(res: dict[str, Any]) -> str:
    lines = [f"healthy DDP jobs, {res['world_size']} ranks (gloo, CPU), {res['setup']['steps']} steps each:"]
    for j in res["jobs"]:
        p = j["ranks"][0]["precursors"]
        lines.append(f"  {j['family']:8s} seed {j['seed']}  incidents {[s for s, _ in j['ranks'][0]['incidents']]}  "
                     f"precursor findings {p['count']} in {p['judged_steps']} judged steps ({p['pages']} pages); "
                     f"ranks agree: values {j['values_agree_after_step_0']}, incidents {j['incidents_agree']}, "
                     f"findings {j['findings_agree']}; {j['ranks'][0]['wall_s']} s")
    p = res["precursors"]
    lines.append(f"precursor findings: {p['findings_per_1000']:.2f} per 1,000 judged job steps ({p['findings']} in "
                 f"{p['judged_steps']}), {p['pages']} pages; false incidents {res['false_incidents']}; "
                 f"{res['wall_s']} s")
    if "drift_replayed" in res:
        p = res["drift_replayed"]
        lines.append(f"drift replayed ({p['settings']}): {p['findings_per_1000']:.2f} per 1,000 judged job steps "
                     f"({p['findings']} in {p['judged_steps']}), {p['pages']} pages")
    return "\n".join(lines)
