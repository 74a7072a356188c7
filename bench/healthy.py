"""False incidents on healthy runs and recall on injected faults: ``python -m bench healthy``.

Tiny HF models of several families (``bench/natural.py``: Qwen2, GPT-NeoX by default) are
pre-trained from scratch on natural text (the standard library's docstrings and the license texts,
byte-level BPE) with gradloc attached at its default settings, from step 0 (the LR warm-up and the
detector's warm-up included):

- a **healthy run** per family × seed: ``steps`` steps, no fault at all. Every incident the monitor
  opens is a false incident.
- a **fault run** per family × seed: the same data (step ``s``'s batch depends only on the seed and
  ``s``), except that one sample of a step is made a fault (``bench.natural_faults.FAULTS``) every
  ``fault_every`` steps on average, from ``fault_after`` on; the kinds take turns. A fault counts as
  detected when an incident opens on its step.

Detection never changes training, so each sensitivity setting is measured by replaying the run's
step records (exactly what the monitor's detector saw) through a fresh detector with that setting
(:func:`replay`). The replay of the default setting must open the same incidents as the live
monitor did (``replay_matches_live``); the benchmark fails otherwise.
"""
from __future__ import annotations

import pickle
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from bench import drift_rates, early, torch_threads
from bench.drift_rates import pooled, run_rates
from bench.healthy_signals import extremes, fault_signals
from bench.natural import Run, RunConfig
from bench.natural_faults import FAULTS, Fault, inject
from gradloc.config import DetectorConfig, DriftConfig
from gradloc.detector import SpikeDetector, opens_incident
from gradloc.records import StepRecord


@dataclass(frozen=True)
class HealthyConfig:
    families: tuple[str, ...] = ("qwen2", "gptneox")
    seeds: int = 3
    steps: int = 2000
    fault_steps: int = 2000  # length of each fault run (0: no fault runs, no recall)
    fault_after: int = 200  # first fault step: after the LR warm-up (100) and the detector's warm-up
    fault_every: int = 100  # mean spacing of faults (each gap uniform in [0.75, 1.25] × this)
    faults: tuple[str, ...] = FAULTS
    settings: tuple[str, ...] = DetectorConfig.SENSITIVITIES
    run: RunConfig = field(default_factory=lambda: RunConfig(d_model=128, n_layers=4))
    threads: int | None = 1

    @staticmethod
    def quick() -> HealthyConfig:
        return HealthyConfig(families=("qwen2",), seeds=1, steps=150, fault_steps=150, fault_after=50,
                             fault_every=25, faults=("planted_token", "foreign_script", "random_ids", "repeated_tail"),
                             run=RunConfig(d_model=32, n_layers=1, seq=32, batch=2))


@dataclass
class Trace:
    """One run's step records and what the live monitor (default detector) opened."""

    family: str
    seed: int
    layers: list[str]
    records: list[StepRecord]
    live_incidents: list[int]
    faults: list[Fault]
    params: int
    wall_s: float
    live_config: DetectorConfig | None = None  # the live monitor's detector (resolved); None: not known
    live_drift: DriftConfig | None = None  # its drift detector's settings; None: not known (an older trace)


def fault_schedule(cfg: HealthyConfig, seed: int) -> dict[int, str]:
    """{step: fault kind}: from ``fault_after`` on, gaps uniform in [0.75, 1.25] × ``fault_every``."""
    gen = torch.Generator().manual_seed(10_007 + seed)
    order = [cfg.faults[i] for i in torch.randperm(len(cfg.faults), generator=gen).tolist()]
    out: dict[int, str] = {}
    s, lo, hi = cfg.fault_after, int(0.75 * cfg.fault_every), int(1.25 * cfg.fault_every)
    while s < cfg.fault_steps - 1:
        out[s] = order[len(out) % len(order)]
        s += int(torch.randint(max(1, lo), max(2, hi + 1), (1,), generator=gen))
    return out


def train(run_cfg: RunConfig, faults: dict[int, str] | None = None,
          progress: Callable[[str], None] | None = None, **watch: Any) -> Trace:
    """One run (``watch``: WatchConfig fields other than the defaults; the benchmark's runs take none)."""
    run = Run(run_cfg, **watch)
    records: list[StepRecord] = []
    injected: list[Fault] = []
    gen = torch.Generator().manual_seed(20_011 + run_cfg.seed)
    t0 = time.perf_counter()
    try:
        for s in range(run_cfg.steps):
            batch = run.batch(s)
            if faults and s in faults:
                injected.append(inject(faults[s], batch, gen, run.model, run.corpus, s))
            records.append(run.step(batch).record)
            if progress is not None and (s + 1) % 500 == 0:
                progress(f"{run_cfg.family} seed {run_cfg.seed} step {s + 1} loss {records[-1].loss:.3f} "
                         f"incidents {len(run.mon.incidents)}")
        live = [i.step for i in run.mon.incidents]
        layers = list(run.mon.layer_stats.layers)
        return Trace(run_cfg.family, run_cfg.seed, layers, records, live, injected, run.params,
                     round(time.perf_counter() - t0, 1), run.mon.detector.config, run.mon.config.precursors.drift)
    finally:
        run.close()


def replay(trace: Trace, det_cfg: DetectorConfig) -> list[tuple[int, tuple[str, ...]]]:
    """(step, kinds) of every incident a detector with ``det_cfg`` opens on ``trace``'s records."""
    det = SpikeDetector(det_cfg, trace.layers)
    out = []
    for rec in trace.records:
        ev = det.observe(rec)
        if opens_incident(ev):
            out.append((rec.step, ev.kinds))
    return out


def _per_1000(n: int, steps: int) -> float:
    return round(1000.0 * n / steps, 2) if steps else 0.0


# rules added to DetectorConfig after a trace may have been recorded, and the value that turns each
# off: a trace pickled before the field existed ran without the rule
_ADDED_RULES = {"sample_ratio": 0.0}


def live_config(trace: Trace) -> DetectorConfig:
    """The trace's live detector config, with the rules it did not have yet turned off."""
    cfg = trace.live_config
    missing = {k: v for k, v in _ADDED_RULES.items() if k not in vars(cfg)}
    return replace(cfg, **missing) if missing else cfg


def check_replay(traces: list[Trace]) -> None:
    """The replay of each trace with its live monitor's detector config must open exactly the
    incidents the live monitor opened (else replaying other settings would measure nothing real)."""
    for t in traces:
        if t.live_config is None:
            continue
        got = [s for s, _ in replay(t, live_config(t))]
        if got != t.live_incidents:
            raise AssertionError(f"replay {got[:20]} != live {t.live_incidents[:20]} ({t.family} seed {t.seed})")


def summarize(cfg: HealthyConfig, healthy: list[Trace], faulty: list[Trace], check_live: bool = True,
              drift: DriftConfig | None = None) -> dict[str, Any]:
    """Per setting: false incidents on the healthy traces, recall on the fault traces; ``drift``: the drift
    detector's findings on the healthy traces under those settings too (a replay). ``check_live`` False: traces
    recorded under another detector version (the live checks cannot hold; ``replay_matches_live`` null)."""
    if check_live:
        check_replay(healthy + faulty)
        for t in healthy:  # a trace pickled before live_drift existed ran under the defaults of its day: unknown
            if t.live_drift is not None:
                drift_rates.check_replay(t.records, t.live_drift, f"{t.family} seed {t.seed}")
    settings: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for t in healthy:
        runs.append({"family": t.family, "seed": t.seed, "steps": len(t.records), "params": t.params,
                     "final_loss": round(t.records[-1].loss, 4), "wall_s": t.wall_s,
                     "live_incidents": len(t.live_incidents), "extremes": extremes(t), "incidents": {},
                     "precursors": run_rates(t.records, (t.live_drift or DriftConfig()).warmup)})
        if drift is not None:
            runs[-1]["precursors_replayed"] = drift_rates.replay_rates(t.records, drift)
    for name in cfg.settings:
        det_cfg = DetectorConfig(sensitivity=name)
        total = steps = 0
        kinds: Counter[str] = Counter()
        judged = []
        for t, row in zip(healthy, runs):
            inc = replay(t, det_cfg)
            judged.append(early.judge(t.records, t.layers, det_cfg))
            row["incidents"][name] = {"count": len(inc), "per_1000": _per_1000(len(inc), len(t.records)),
                                      "steps": [s for s, _ in inc][:50], "from_step0": judged[-1]}
            total += len(inc)
            steps += len(t.records)
            kinds.update(k for _, ks in inc for k in ks)
        found: Counter[str] = Counter()
        injected: Counter[str] = Counter()
        extra = fault_steps = 0
        for t in faulty:
            inc = dict(replay(t, det_cfg))
            at = {f.step for f in t.faults}
            for f in t.faults:
                injected[f.kind] += 1
                found[f.kind] += f.step in inc
            extra += sum(1 for s in inc if s not in at)
            fault_steps += len(t.records)
        settings[name] = {
            "false_per_1000": _per_1000(total, steps), "false_incidents": total, "healthy_steps": steps,
            "kinds": dict(kinds),
            "recall": {k: round(found[k] / injected[k], 3) for k in cfg.faults if injected[k]},
            "detected": dict(found), "injected": dict(injected),
            "fault_run_other_incidents_per_1000": _per_1000(extra, fault_steps),
            "from_step0": early.summarize(judged, steps),
        }
    return {"settings": settings, "runs": runs, "replay_matches_live": True if check_live else None,
            "precursors": pooled([r["precursors"] for r in runs]),
            **({} if drift is None else {"drift_replayed": dict(settings=asdict(drift), **pooled(
                [r["precursors_replayed"] for r in runs]))}),
            "fault_signals": fault_signals(faulty),
            "fault_runs": [{"family": t.family, "seed": t.seed, "steps": len(t.records), "faults": len(t.faults),
                            "live_incidents": len(t.live_incidents), "wall_s": t.wall_s} for t in faulty]}


def run_healthy(cfg: HealthyConfig, progress: Callable[[int, int, Any], None] | None = None,
                traces: str | None = None, from_traces: bool = False, check_live: bool = True,
                reuse: bool = False, drift: DriftConfig | None = None) -> dict[str, Any]:
    """Train the runs (or, ``from_traces``, load the ones saved in ``traces``) and summarize.

    ``traces``: a directory where each run's trace is pickled (``<kind>-<family>-<seed>.pkl``), so
    that settings can be compared again later without training (``from_traces``): the replay is
    checked against each trace's own live monitor either way. ``reuse``: a run whose trace is already in
    ``traces`` is loaded instead of trained (more seeds added to a measured set). ``drift``: other drift settings,
    replayed over the healthy runs (:func:`summarize`).
    """
    from bench.natural import natural_corpus

    t0 = time.perf_counter()
    healthy: list[Trace] = []
    faulty: list[Trace] = []
    jobs = [(f, s) for f in cfg.families for s in range(cfg.seeds)]
    reused: list[str] = []  # traces loaded by ``reuse`` (trained in an earlier run)
    n = len(jobs) * (2 if cfg.fault_steps else 1)
    say = (lambda msg: progress(len(healthy) + len(faulty), n, msg)) if progress else None

    def get(kind: str, rc: RunConfig, faults: dict[int, str] | None) -> Trace:
        path = Path(traces, f"{kind}-{rc.family}-{rc.seed}.pkl") if traces else None
        if from_traces or (reuse and path is not None and path.exists()):
            assert path is not None
            if not from_traces:
                reused.append(path.name)
            with path.open("rb") as f:
                return pickle.load(f)
        trace = train(rc, faults, say)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as f:
                pickle.dump(trace, f)
        return trace

    with torch_threads(cfg.threads):
        for family, seed in jobs:
            rc = replace(cfg.run, family=family, seed=seed, steps=cfg.steps)
            healthy.append(get("healthy", rc, None))
            if cfg.fault_steps:
                rc = replace(rc, steps=cfg.fault_steps)
                faulty.append(get("fault", rc, fault_schedule(cfg, seed)))
    res = summarize(cfg, healthy, faulty, check_live, drift)
    r = cfg.run
    res["setup"] = {"families": list(cfg.families), "seeds": cfg.seeds, "steps": cfg.steps,
                    "fault_steps": cfg.fault_steps, "fault_after": cfg.fault_after, "fault_every": cfg.fault_every,
                    "d_model": r.d_model, "n_layers": r.n_layers, "seq": r.seq, "micro_batches": r.micro_batches,
                    "batch": r.batch, "lr": r.lr, "lr_warmup": r.lr_warmup, "corpus": natural_corpus(r.vocab).info(),
                    "torch_threads": torch.get_num_threads() if cfg.threads is None else cfg.threads,
                    "from_traces": bool(from_traces), "reused_traces": reused}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def format_table(res: dict[str, Any]) -> str:
    faults = sorted({k for s in res["settings"].values() for k in s["recall"]})
    head = ("sensitivity", "false /1000", "false", "healthy steps", *[f"recall {k}" for k in faults],
            "other /1000 (fault runs)")
    rows = [head]
    for name, s in res["settings"].items():
        rows.append((name, f"{s['false_per_1000']:.2f}", str(s["false_incidents"]), str(s["healthy_steps"]),
                     *[f"{s['recall'].get(k, 0):.2f} ({s['detected'].get(k, 0)}/{s['injected'].get(k, 0)})"
                       for k in faults], f"{s['fault_run_other_incidents_per_1000']:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines += ["", f"from step 0 (bench/early.py: a real spike is >= {early.RATIO}x the median norm of the "
              f"{early.WINDOW} steps either side):"]
    for name, s in res["settings"].items():
        e = s["from_step0"]
        lines.append(f"  {name:8s} real spikes after the warm-up flagged {e['flagged']}/{e['real_spikes_after_warmup']}"
                     f"; warm-up spikes reported {e['warmup_reported']}/{e['warmup_spikes']}; incidents on real "
                     f"spikes {e['incidents_on_real_spikes']}; false on no real spike {e['strict_false']} "
                     f"({e['strict_false_per_1000']:.2f} /1000)")
    lines += ["", "healthy runs (incidents per 1,000 steps per setting):"]
    for r in res["runs"]:
        per = "  ".join(f"{k} {v['per_1000']:.2f}" for k, v in r["incidents"].items())
        x = r["extremes"]
        lines.append(f"  {r['family']:8s} seed {r['seed']}  {r['steps']} steps  {r['params']:,} params  "
                     f"final loss {r['final_loss']:.3f}  {per}  (norm up to {x['norm_ratio_max']:.2f}× its mean, "
                     f"z up to {x['norm_z_max']:.0f}; loss z up to {x['loss_z_max']:.2f}; {r['wall_s']} s)")
        p = r["precursors"]
        lines.append(f"    precursor findings {p['count']} in {p['judged_steps']} judged steps, {p['pages']} pages")
    for name, label in (("precursors", "live drift detector"), ("drift_replayed", "drift replayed")):
        if name in res:
            p = res[name]
            lines.append(f"precursor findings ({label}): {p['findings_per_1000']:.2f} per 1,000 judged steps "
                         f"({p['findings']} in {p['judged_steps']}), {p['pages']} pages")
    s = res["setup"]
    lines.append(f"{s['micro_batches']} × ({s['batch']} × {s['seq']}) tokens/step, d_model {s['d_model']}, "
                 f"{s['n_layers']} layers; corpus {s['corpus']['tokens']:,} tokens; total {res['wall_s']} s")
    return "\n".join(lines)
