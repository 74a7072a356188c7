"""Real data faults on a model pre-trained on natural text: ``python -m bench localization --faults``.

Per seed, one tiny HF model (``bench/natural.py``: Qwen2 by default, trained from scratch on the
standard library's docstrings and the license texts, byte-level BPE) trains with gradloc attached
at its default settings (``--sensitivity`` of ``python -m bench faults`` changes the detector's) and the
probe closure (``Run.step``). That run is the **healthy run**: every
incident it opens and every sample it flags from the end of the LR warm-up (``RunConfig.lr_warmup``: 100) on
is false, counted per 1,000 healthy steps (the outliers also per 1,000 judged samples); the fault window
``[pretrain, pretrain + window)`` is broken out, and incidents between the detector's warm-up and step 100
are listed apart (``early_incidents``).

Each fault kind gets one random step in ``[pretrain, pretrain + window - after)`` per seed. At that
step the run makes an **excursion**: model, optimizer and the monitor's detector and sample-judge
state are snapshotted, one random sample of the step's data is made the fault, the step runs
through the monitor (``end_step(loss, probe=closure)``, then clipping and AdamW as usual), then
``after`` healthy steps follow (an incident there is an *aftershock*); then the snapshot is
restored and the healthy run goes on exactly as if nothing had happened (the data of step ``s``
depends only on (seed, s); ``tests/bench/test_faults_bench.py`` checks the losses bit for bit). So every
fault is the first of its kind the model sees, at a step of an otherwise healthy run.

Faults (``LEVEL`` gives the level each is planted at):

- ``repeated_tail`` (span): the second half of the sample is one token of the sample repeated
  (``natural_faults.inject``); the planted span is the loss positions whose target is the repeated token;
- ``foreign_script`` (sample): the whole sample is random words of another script (``natural_faults.inject``);
- ``random_ids`` (sample): uniformly random ids, binary garbage (``natural_faults.inject``);
- ``shifted_labels_5`` (sample): each label is the token 5 positions later (``samples.make_fault``);
- ``duplicated_sample`` (sample ×2): one garbage (random-id) sample appears twice in the step, in two
  random slots;
- ``duplicated_document`` (span): the sample's second half repeats its first half
  (``samples.make_fault("duplicated")``); the planted span is the repeated half's loss positions;
- ``truncated`` (span): the document stops half-way and the rest is end-of-text padding the loss
  still counts (``samples.make_fault``); the planted span is the padding's loss positions;
- ``planted_token`` (token, the control): the sample's least likely target gets loss weight
  ``natural_faults.PLANT_SHARE`` × the step's loss tokens (the demo's RL plant, ``natural_faults.inject``).

Scoring, per fault step:

- **detected**: an incident opened at the fault step;
- the localization **names** the (micro-batch, sample) of its spans and culprits when its status is
  ``located`` (a ``micro_batch``-level or ``diffuse`` result names no sample);
- **sample recall** = planted samples named / planted samples, over every injected fault (a missed
  spike is a miss); **sample precision** = planted samples named / samples named, pooled over the
  located incidents (naming another sample counts against it);
- **token recall / precision** (span and token faults): the loss positions the spans and culprits
  name inside all samples against the planted positions; ``iou``: their intersection over union;
- **wrong**: located incidents that name none of the planted samples (another sample, or at the
  ``micro_batch`` level a micro-batch without the fault);
- **probes** and **passes** (``Localization.probes``, ``.passes``) of each incident;
- **outlier**: a ``surprise`` ``SampleOutlier`` names the faulty sample on the fault step.
"""
from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from bench import torch_threads
from bench.faults_score import LEVEL, Cell, format_table, score, summarize
from bench.natural import Run, RunConfig, StepBatch, natural_corpus
from bench.natural_faults import inject
from bench.samples import make_fault

FAULTS = ("repeated_tail", "foreign_script", "random_ids", "shifted_labels_5", "duplicated_sample",
          "duplicated_document", "truncated", "planted_token")


@dataclass(frozen=True)
class FaultsConfig:
    seeds: int = 5
    pretrain: int = 300  # healthy steps before the fault window (LR warm-up 100, detector and sample warm-ups)
    window: int = 100  # fault steps are drawn in [pretrain, pretrain + window - after)
    after: int = 2  # healthy steps run after the fault inside its excursion (aftershock incidents)
    faults: tuple[str, ...] = FAULTS
    run: RunConfig = field(default_factory=lambda: RunConfig(seq=128, batch=8, micro_batches=2, d_model=128,
                                                             n_layers=2, steps=400))
    threads: int | None = 1
    sensitivity: str = "default"  # DetectorConfig(sensitivity=...): which spikes open an incident

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULTS}")
        if self.window <= self.after:
            raise ValueError("window must be > after")

    @property
    def steps(self) -> int:
        return self.pretrain + self.window

    @staticmethod
    def quick(**kw: Any) -> FaultsConfig:
        base = dict(seeds=1, pretrain=40, window=10, after=1, faults=("random_ids", "planted_token"),
                    run=RunConfig(seq=32, batch=4, micro_batches=2, d_model=32, n_layers=1, steps=50))
        return FaultsConfig(**{**base, **kw})


@dataclass
class Planted:
    kind: str
    step: int
    level: str
    cells: list[Cell]
    positions: dict[Cell, set[int]]  # planted loss positions per cell (a sample fault: all of them)
    detail: str = ""


# -- the faults -------------------------------------------------------------------------------------
def plant(kind: str, batch: StepBatch, gen: torch.Generator, run: Run, step: int) -> Planted:
    """Make ``batch`` (in place) carry one ``kind`` fault in random sample(s); what was planted where."""
    M, B, T = batch.weights.shape
    h = (T + 1) // 2
    if kind in ("repeated_tail", "foreign_script", "random_ids", "planted_token"):
        f = inject(kind, batch, gen, run.model, run.corpus, step)
        cell = (f.micro_batch, f.sample)
        pos: dict[Cell, set[int]] = {}
        if kind == "repeated_tail":  # targets t >= T//2 - 1 are the repeated token (window index t + 1)
            pos[cell] = set(range(T // 2 - 1, T))
        elif kind == "planted_token":
            pos[cell] = {int(batch.weights[f.micro_batch, f.sample].argmax())}
        else:
            pos[cell] = set(range(T))
        return Planted(kind, step, LEVEL[kind], [cell], pos, f.detail)
    if kind == "duplicated_sample":
        f = inject("random_ids", batch, gen, run.model, run.corpus, step)
        first = (f.micro_batch, f.sample)
        others = [(m, b) for m in range(M) for b in range(B) if (m, b) != first]
        second = others[int(torch.randint(0, len(others), (1,), generator=gen))]
        batch.windows[second] = batch.windows[first].clone()
        return Planted(kind, step, "sample", sorted([first, second]), {c: set(range(T)) for c in (first, second)})
    sub = {"shifted_labels_5": "shifted_labels_5", "duplicated_document": "duplicated", "truncated": "truncated"}[kind]
    cell = make_fault(sub, batch, gen, run, step)
    pos = {}
    if kind == "truncated":  # window ids >= h are end-of-text: targets t >= h - 1
        pos[cell] = set(range(h - 1, T))
    elif kind == "duplicated_document":  # window ids [h, 2h) repeat [0, h): targets [h - 1, 2h - 1)
        pos[cell] = set(range(h - 1, min(T, 2 * h - 1)))
    else:
        pos[cell] = set(range(T))
    return Planted(kind, step, LEVEL[kind], [cell], pos)


# -- excursions: branch off the healthy run and come back -------------------------------------------
class Snapshot:
    """Everything a step changes: model, optimizer, the monitor's detector and sample judges, counters."""

    def __init__(self, run: Run) -> None:
        mon = run.mon
        self.model = copy.deepcopy(run.model.state_dict())
        self.opt = copy.deepcopy(run.opt.state_dict())
        self.detector = copy.deepcopy(mon.detector)
        self.judge = copy.deepcopy(mon.samples.judge)
        self.mismatch = copy.deepcopy(mon.samples.mismatch)
        self.step, self.ended, self.held = mon.step, mon._ended, mon._fanout.held  # the step record held a step
        self.incidents, self.history = len(mon.incidents), list(mon.history)
        self.step_no = run.step_no

    def restore(self, run: Run) -> None:
        mon = run.mon
        run.model.load_state_dict(self.model)
        run.opt.load_state_dict(copy.deepcopy(self.opt))
        run.opt.zero_grad(set_to_none=True)
        mon.detector = copy.deepcopy(self.detector)
        mon.samples.judge = copy.deepcopy(self.judge)
        mon.samples.mismatch = copy.deepcopy(self.mismatch)
        mon.step, mon._ended, mon._fanout.held = self.step, self.ended, self.held
        del mon.incidents[self.incidents:]
        mon.history.clear()
        mon.history.extend(self.history)
        run.step_no = self.step_no


# -- one seed ---------------------------------------------------------------------------------------
def run_seed(cfg: FaultsConfig, seed: int, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from gradloc.config import DetectorConfig

    rc = replace(cfg.run, seed=seed, steps=cfg.steps)
    run = Run(rc, detector=DetectorConfig(sensitivity=cfg.sensitivity))
    plan: dict[int, list[tuple[str, torch.Generator]]] = {}
    for kind in cfg.faults:  # seeded by the kind's place in FAULTS: a subset draws the same steps and samples
        gen = torch.Generator().manual_seed(50_021 + 1_009 * seed + FAULTS.index(kind))
        s = cfg.pretrain + int(torch.randint(0, cfg.window - cfg.after, (1,), generator=gen))
        plan.setdefault(s, []).append((kind, gen))
    rows: list[dict[str, Any]] = []
    losses: list[float] = []
    # healthy steps: from the end of the LR warm-up on (`early`: from the detector's warm-up to there)
    healthy: dict[str, Any] = {"steps": 0, "incidents": [], "outliers": 0, "judged": 0, "window_steps": 0,
                               "window_incidents": 0, "window_outliers": 0, "early_steps": 0, "early_incidents": [],
                               "early_outliers": 0}
    warm, count_from = run.mon.detector.config.warmup, min(rc.lr_warmup, cfg.pretrain)
    t0 = time.perf_counter()
    try:
        for s in range(cfg.steps):
            for kind, gen in plan.get(s, []):
                snap = Snapshot(run)
                batch = run.batch(s)
                p = plant(kind, batch, gen, run, s)
                report = run.step(batch)
                after = [s + 1 + k for k in range(cfg.after) if run.step().incident is not None]
                snap.restore(run)
                rows.append({**score(p, report, after), "seed": seed})
                if progress is not None:
                    r = rows[-1]
                    progress(f"seed {seed} step {s} {kind}: {r['status']} {r['level'] or '-'} named {r['named']} "
                             f"planted {r['planted']} probes {r['probes']} outlier {r['outlier_hits']}")
            report = run.step()
            rec = report.record
            losses.append(rec.loss)
            flagged = rec.samples.flagged if rec.samples is not None else 0
            if s >= count_from:
                healthy["steps"] += 1
                healthy["outliers"] += flagged
                healthy["judged"] += rec.samples.judged if rec.samples is not None else 0
                if report.incident is not None:
                    loc = report.incident.localization
                    healthy["incidents"].append({"step": s, "kinds": list(report.spike.kinds),
                                                 "status": str(loc.status) if loc else None,
                                                 "level": str(loc.level) if loc else None})
                if s >= cfg.pretrain:
                    healthy["window_steps"] += 1
                    healthy["window_incidents"] += report.incident is not None
                    healthy["window_outliers"] += flagged
            elif s >= warm:
                healthy["early_steps"] += 1
                healthy["early_outliers"] += flagged
                if report.incident is not None:
                    healthy["early_incidents"].append(s)
        return {"seed": seed, "rows": rows, "healthy": healthy, "params": run.params,
                "loss_at_pretrain": round(losses[cfg.pretrain - 1], 4), "final_loss": round(losses[-1], 4),
                "losses": losses, "wall_s": round(time.perf_counter() - t0, 1)}
    finally:
        run.close()


# -- summary ----------------------------------------------------------------------------------------
def run_faults(cfg: FaultsConfig, progress: Callable[[int, int, Any], None] | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    seeds: list[dict[str, Any]] = []
    with torch_threads(cfg.threads):
        threads = torch.get_num_threads()
        for seed in range(cfg.seeds):
            say = (lambda msg: progress(seed, cfg.seeds, msg)) if progress is not None else None
            seeds.append(run_seed(cfg, seed, say))
    res = summarize(cfg, seeds)
    r = cfg.run
    res["runs"] = [{k: v for k, v in s.items() if k not in ("rows", "healthy", "losses")} for s in seeds]
    res["setup"] = {"family": r.family, "seeds": cfg.seeds, "pretrain": cfg.pretrain, "window": cfg.window,
                    "after": cfg.after, "steps": cfg.steps, "d_model": r.d_model, "n_layers": r.n_layers,
                    "seq": r.seq, "micro_batches": r.micro_batches, "batch": r.batch, "lr": r.lr,
                    "params": seeds[0]["params"] if seeds else None, "corpus": natural_corpus(r.vocab).info(),
                    "torch_threads": threads, "torch_version": torch.__version__, "faults": list(cfg.faults),
                    "sensitivity": cfg.sensitivity}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return res


def from_args(args: Any, **overrides: Any) -> dict[str, Any]:
    """``python -m bench localization --faults`` (its ``--seeds``, ``--train-steps``, ``--threads``, ``--quick``)."""
    cfg = FaultsConfig.quick() if args.quick else FaultsConfig()
    cfg = replace(cfg, **overrides)
    if getattr(args, "seeds", None) is not None:
        cfg = replace(cfg, seeds=args.seeds)
    if getattr(args, "train_steps", None) is not None:
        cfg = replace(cfg, pretrain=args.train_steps)
    if getattr(args, "threads", None) is not None:
        cfg = replace(cfg, threads=args.threads or None)
    prog = None
    if getattr(args, "verbose", False):
        import sys

        def prog(i: int, n: int, info: Any) -> None:
            print(f"[{i + 1}/{n}] {info}", file=sys.stderr, flush=True)
    return run_faults(cfg, prog)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench faults``: the same bench with the detector's sensitivity as a flag."""
    import argparse
    import json

    from gradloc.config import DetectorConfig

    parser = argparse.ArgumentParser(prog="python -m bench faults", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=None, help="seeds (default 5; 1 with --quick)")
    parser.add_argument("--train-steps", type=int, default=None, help="steps before the fault window (default 300)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default 1; 0 = torch's)")
    parser.add_argument("--sensitivity", choices=DetectorConfig.SENSITIVITIES, default="default",
                        help="DetectorConfig(sensitivity=...) of the monitor (default: default)")
    parser.add_argument("--faults", default=None, help=f"comma-separated subset of {','.join(FAULTS)}")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="a small, fast version (smoke tests)")
    parser.add_argument("--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    extra: dict[str, Any] = {"sensitivity": args.sensitivity}
    if args.faults:
        extra["faults"] = tuple(args.faults.split(","))
    res = from_args(args, **extra)
    print(json.dumps(res) if args.json else format_table(res))
    return 0


__all__ = ["FAULTS", "LEVEL", "FaultsConfig", "Planted", "Snapshot", "plant", "run_faults", "format_table"]


if __name__ == "__main__":
    import sys

    sys.exit(main())
