"""From the pattern to the fix on a real data mixture: ``python -m bench patterns [--json] [--quick] [--seeds N]``.

The issue's loop, end to end, with the real components: four sources of real offline text, each an HF
``datasets.Dataset`` of fixed byte windows whose origin is the file and line they come from
(bench/patterns_data.py), through ``with_provenance``, ``concatenate_datasets``, a torch ``DataLoader`` with a
``RandomSampler`` and ``ProvenanceCollator(default_data_collator)``; one or two sources carry faults in a few
percent of their rows (garbage bytes, mis-decoded UTF-16, labels that are the inputs), the same rows every epoch.

Per seed:

1. **pre-training**: samples_text's byte-level ``GPT2LMHeadModel`` (3 layers, d 128, dropout 0.1, initialised per
   seed) trained without gradloc on clean windows of the same four kinds of text that the mixture did not take
   (``patterns_data.held_out``: the same files, other rows — samples_text's own streams would read every corpus
   again, ~20 s, and hold the mixture's rows);
2. **measured phase**: ``epochs`` epochs over the faulty mixture with gradloc watching (default
   ``SampleConfig``/``DetectorConfig``), each micro-batch with its rows' ``SampleInfo``s and a loss mask, an
   in-process agent core (``EmbeddedAgent``) storing steps, incidents and outliers in a fresh SQLite store and
   quarantining by policy (``QuarantinePolicy(culprits=True, outlier_z=quarantine_z)``);
3. **the findings**: ``patterns.from_store`` (sources ranked by culprits + outliers per million tokens), every
   stored flag followed back to its row (bench/patterns_score.py), the quarantine list against the ground truth;
4. **restart**: the list exported by the real ``gradloc-agent quarantine export``, loaded with
   ``QuarantineList.load``, extended with the rows that look like quarantined ones (``with_lookalikes``: the
   content faults the model learned before gradloc met all their rows), saved and put back into the store with
   ``gradloc-agent quarantine import``; one more epoch through ``QuarantineSampler`` (``filter_dataset`` counted beside
   it), trained with gradloc watching as a second job: which rows were drawn, and what was flagged then.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from bench import torch_threads
from bench.patterns_loop import EPOCH_SEED, PatternsConfig, Trainer, loader_of, train_phase, watch_with_agent


def run_seed(cfg: PatternsConfig, seed: int, workdir: Path, progress: Any = None) -> dict[str, Any]:
    from bench import patterns_data, patterns_score

    t0 = time.time()
    mix = patterns_data.pick(seed, cfg.rows_per_source, cfg.seq, cfg.fault_rate, limit=cfg.corpus_bytes)
    ds = patterns_data.dataset(mix)
    trainer = Trainer(cfg, seed)
    pre_loss = trainer.pretrain(patterns_data.held_out(mix, cfg.seq, cfg.corpus_bytes), seed)
    t_pre = time.time()
    db = str(workdir / f"seed{seed}.db")
    for stale in (db, db + "-wal", db + "-shm", str(workdir / f"quarantine-{seed}.jsonl"),
                  str(workdir / f"quarantine-{seed}-lookalikes.jsonl")):
        Path(stale).unlink(missing_ok=True)  # a kept folder used again: this run's store only
    job = f"patterns-{seed}"
    mon, agent = watch_with_agent(trainer, job, db, cfg.quarantine_z)
    draws = patterns_score.Draws(mix.faults)

    losses: list[float] = []
    for epoch in range(cfg.epochs):
        losses += train_phase(trainer, loader_of(ds, cfg, seed * EPOCH_SEED + epoch), mon, draws.note)
        if progress:
            progress(epoch, cfg.epochs, f"seed {seed}: epoch {epoch + 1}, loss {losses[-1]:.3f}")
    mon.close()
    dropped = agent.dropped
    t_measured = time.time()
    found = patterns_score.findings(db, job, mix, draws.fed, cfg.seq)
    restart_out = restart(cfg, seed, mix, ds, db, workdir, trainer)
    return {"seed": seed, "faulty_sources": list(mix.faulty_sources), "faulty_rows": len(mix.faults),
            "faults_by_kind": patterns_score.count(mix.faults.values()), "rows": len(ds),
            "pretrain_loss": round(pre_loss, 3), "measured_loss_last": round(sum(losses[-20:]) / len(losses[-20:]), 3),
            "measured_steps": len(losses), "agent_dropped": dropped, "live": draws.summary(), **found, "restart": restart_out,
            "seconds": {"pretrain": round(t_pre - t0, 1), "measured": round(t_measured - t_pre, 1),
                        "restart": round(time.time() - t_measured, 1)}}


def restart(cfg: PatternsConfig, seed: int, mix: Any, ds: Any, db: str, workdir: Path, trainer: Any) -> dict[str, Any]:
    """Step 4 (module docstring): one epoch after a restart, through the loader helper."""
    from torch.utils.data import RandomSampler

    from bench.patterns_score import Draws, flags_of
    from gradloc.agent import patterns
    from gradloc.agent.cli import main as agent_cli
    from gradloc.integrations.provenance import ORIGIN, SOURCE
    from gradloc.integrations.quarantine import QuarantineList, QuarantineSampler, dataset_keys

    out = workdir / f"quarantine-{seed}.jsonl"
    with contextlib.redirect_stdout(io.StringIO()) as said:  # the CLI's own line, kept out of --json's stdout
        agent_cli.main(["quarantine", "export", "--db", db, str(out)], standalone_mode=False)
    found = QuarantineList.load(out)
    q = found.with_lookalikes(ds["input_ids"], dataset_keys(ds))  # rows that look like quarantined ones
    extended = workdir / f"quarantine-{seed}-lookalikes.jsonl"
    q.save(extended)
    with contextlib.redirect_stdout(io.StringIO()) as imported:  # back into the store: the team's list has them
        agent_cli.main(["quarantine", "import", "--db", db, str(extended)], standalone_mode=False)
    looks = {e.value: e for e in q.entries[len(found.entries):]}
    origins, sources = ds[ORIGIN], ds[SOURCE]
    gen = torch.Generator().manual_seed(seed * EPOCH_SEED + cfg.epochs)
    sampler = QuarantineSampler(RandomSampler(ds, generator=gen), q, key=lambda i: (None, origins[i], sources[i]),
                                size=len(ds))
    by_filter = QuarantineList.load(extended)
    kept = by_filter.filter_dataset(ds)
    quarantined = {origins[i] for i in sampler.blocked}
    job = f"patterns-{seed}-restart"
    mon, agent = watch_with_agent(trainer, job, db, cfg.quarantine_z)
    drawn: Counter[str] = Counter()
    live = Draws(mix.faults)

    def note(report: Any, micro: list) -> None:
        drawn.update(info.origin for _, _, _, infos in micro for info in infos)
        live.note(report, micro)

    train_phase(trainer, loader_of(ds, cfg, seed, sampler=sampler), mon, note)
    mon.close()
    expected = {o for o in origins if o not in quarantined}
    clean_expected = expected - set(mix.faults)
    from gradloc.store.sqlite import IncidentStore

    with IncidentStore(db) as store:
        rows = patterns.from_store(store, job=job).of("source")
        flagged = [o for *_, o, _ in flags_of(store, job) if o is not None]
    return {"export_said": said.getvalue().strip().split(" written")[0],  # "N entries" (the path is the run's)
            "exported": len(found.entries), "bad_lines": found.bad_lines,
            "lookalikes": {"added": len(looks), "imported": imported.getvalue().strip(),
                           "faulty": sum(1 for o in looks if o in mix.faults),
                           "clean": sum(1 for o in looks if o not in mix.faults),
                           "by_fault": dict(Counter(mix.faults[o] for o in looks if o in mix.faults)),
                           "clean_rows": {o: looks[o].reason for o in sorted(looks) if o not in mix.faults}},
            "skipped": dict(q.skipped), "filter_dataset_kept": len(kept),
            "filter_dataset_skipped": dict(by_filter.skipped), "sampler_len": len(sampler),
            "quarantined_rows": len(quarantined), "quarantined_drawn": sum(drawn[o] for o in quarantined),
            "clean_expected": len(clean_expected), "clean_drawn": len(clean_expected & set(drawn)),
            "clean_drawn_twice": sum(1 for o in clean_expected if drawn[o] > 1), "draws": sum(drawn.values()),
            "faulty_drawn": sum(drawn[o] for o in mix.faults), "drawn_outside": len(set(drawn) - expected),
            "agent_dropped": agent.dropped, "flags": len(flagged),
            "flags_on_faulty": sum(1 for o in flagged if o in mix.faults),
            "live": live.summary(),  # the restart's judge has its own warm-up: what it judged, what it flagged
            "order": [r.name for r in rows],
            "per_million": {r.name: None if r.per_million is None else round(r.per_million, 1) for r in rows}}


def run_patterns(cfg: PatternsConfig, progress: Any = None, keep: str | None = None,
                 seeds: list[int] | None = None) -> dict[str, Any]:
    """Every seed (``seeds``, default 0 … cfg.seeds - 1); ``keep``: a folder for the stores and quarantine lists
    (``gradloc-agent patterns --db DIR/seed0.db``), else a temporary one."""
    import datasets

    from bench import patterns_score

    torch_threads(cfg.threads)
    datasets.disable_progress_bars()
    datasets.disable_caching()  # every map in memory: nothing of one seed's faults lands in a shared cache
    t0 = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-patterns-") as tmp:
        where = Path(keep or tmp)
        where.mkdir(parents=True, exist_ok=True)
        for seed in seeds if seeds is not None else range(cfg.seeds):
            runs.append(run_seed(cfg, seed, where, progress))
    return {"config": asdict(cfg), "seconds": round(time.time() - t0, 1), "runs": runs,
            "total": patterns_score.total(runs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench patterns", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="one seed, a small mixture, few steps (smoke test)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0 … N-1 (default 3; 1 with --quick)")
    parser.add_argument("--seed", type=int, default=None, help="only this seed")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep each seed's store and quarantine list here")
    parser.add_argument("--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    cfg = PatternsConfig.quick() if args.quick else PatternsConfig()
    if args.seeds is not None or args.seed is not None:
        cfg = replace(cfg, seeds=1 if args.seed is not None else args.seeds)
    progress = (lambda i, n, info: print(f"[{i + 1}/{n}] {info}", file=sys.stderr, flush=True)) if args.verbose \
        else None
    from bench.patterns_score import format_table

    out = run_patterns(cfg, progress, keep=args.keep, seeds=None if args.seed is None else [args.seed])
    print(json.dumps(out) if args.json else format_table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
