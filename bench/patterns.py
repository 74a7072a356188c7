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
   ``QuarantineList.load``; one more epoch through ``QuarantineSampler`` (``filter_dataset`` counted beside
   it), trained with gradloc watching as a second job: which rows were drawn, and what was flagged then.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench import torch_threads

EPOCH_SEED = 1_000_003


@dataclass(frozen=True)
class PatternsConfig:
    seeds: int = 3
    rows_per_source: int = 300
    fault_rate: float = 0.04  # of a faulty source's rows
    pretrain_steps: int = 300
    epochs: int = 3  # measured epochs over the mixture (every faulty row is drawn this many times)
    micro_batches: int = 2
    batch: int = 8
    seq: int = 128
    d_model: int = 128
    n_layers: int = 3
    dropout: float = 0.1
    lr: float = 2e-3
    lr_warmup: int = 50
    min_lr_ratio: float = 0.1
    quarantine_z: float = 6.0  # QuarantinePolicy.outlier_z
    corpus_bytes: int = 3_000_000  # files read per kind, at most about (bench/patterns_data.py)
    threads: int | None = 1

    @staticmethod
    def quick() -> "PatternsConfig":
        return PatternsConfig(seeds=1, rows_per_source=48, pretrain_steps=40, epochs=3, corpus_bytes=600_000)

    @property
    def steps_per_epoch(self) -> int:
        return -(-4 * self.rows_per_source // (self.micro_batches * self.batch))

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine to ``min_lr_ratio`` × lr over pre-training, measured and restart phases."""
        if step < self.lr_warmup:
            return self.lr * (step + 1) / self.lr_warmup
        total = self.pretrain_steps + (self.epochs + 1) * self.steps_per_epoch
        p = min(1.0, (step - self.lr_warmup) / max(1, total - self.lr_warmup))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


class Trainer:
    """The user's loop: model, AdamW with decay on matrices, clipping at 1.0, one LR schedule over every phase."""

    def __init__(self, cfg: PatternsConfig, seed: int) -> None:
        from bench.samples_text import TextConfig, _model

        self.cfg, self.step_no, self.report = cfg, 0, None
        self.model = _model(TextConfig(seq=cfg.seq, d_model=cfg.d_model, n_layers=cfg.n_layers, dropout=cfg.dropout,
                                       seed=seed))
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(0.9, 0.95))

    def pretrain(self, text: dict[str, list[bytes]], seed: int) -> float:
        """``pretrain_steps`` on clean windows of the four kinds the mixture did not take (no gradloc, no faults):
        each sample a random kind, then a random window of it. The last 20 steps' mean loss."""
        gen = torch.Generator().manual_seed(seed * EPOCH_SEED - 1)
        kinds = [k for k in text if text[k]]
        n, losses = self.cfg.micro_batches * self.cfg.batch, []
        for _ in range(self.cfg.pretrain_steps):
            rows = []
            for k in torch.randint(0, len(kinds), (n,), generator=gen).tolist():
                pool = text[kinds[k]]
                rows.append(list(pool[int(torch.randint(0, len(pool), (1,), generator=gen))]))
            w = torch.tensor(rows).view(self.cfg.micro_batches, self.cfg.batch, -1)  # (M, B, T + 1)
            losses.append(self.step([(w[i, :, :-1], w[i, :, 1:], None, None) for i in range(len(w))], None))
        tail = losses[-20:]
        return sum(tail) / len(tail)

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list | None]],
             mon: Any) -> float:
        """One optimizer step over micro-batches of (inputs, labels, loss mask, SampleInfos); the mean token loss."""
        from bench.natural import token_losses

        for g in self.opt.param_groups:
            g["lr"] = self.cfg.lr_at(self.step_no)
        n = sum(int(x.numel()) if m is None else int(m.sum()) for x, _, m, _ in micro)

        def loss_for(i: int, mask: torch.Tensor | None = None) -> torch.Tensor:
            x, y, m, _ = micro[i]
            w = torch.ones_like(y, dtype=torch.float32) if m is None else m.float()
            w = w if mask is None else w * mask
            return (token_losses(self.model(input_ids=x).logits, y) * w).sum() / n

        total = torch.zeros(())
        for i, (_, y, m, infos) in enumerate(micro):
            if mon is None:
                loss = loss_for(i)
                loss.backward()
            else:
                with mon.micro_batch(y, loss_mask=m, sample_infos=infos):
                    loss = loss_for(i)
                    loss.backward()
            total += loss.detach()
        if mon is not None:
            self.report = mon.end_step(total, probe=loss_for)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1
        return float(total)


def _watch(trainer: Trainer, job: str, db: str, quarantine_z: float) -> tuple[Any, Any]:
    """gradloc watching ``trainer``'s model, its records going to an in-process agent core with the quarantine
    policy on (``WatchConfig`` has no field for the core's config, so the ``EmbeddedAgent`` is built here and
    given as the monitor's sink, as ``watch`` would build it)."""
    import gradloc
    from bench.samples_text import decode
    from gradloc.agent.core import CoreConfig
    from gradloc.agent.embedded import EmbeddedAgent
    from gradloc.agent.quarantine_policy import QuarantinePolicy

    agent = EmbeddedAgent(job=job, store_path=db, core_config=CoreConfig(
        quarantine=QuarantinePolicy(culprits=True, outlier_z=quarantine_z)))
    mon = gradloc.watch(trainer.model, trainer.opt, job=job, embedded=False, sinks=[agent], update_ratio="off",
                        max_overhead=None, decode=decode)  # no shedding: what is judged must not depend on timing
    return mon, agent


def _micro_batches(loader: Any, m: int) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]]]:
    """The loader's batches, ``m`` at a time (one optimizer step), each as (inputs, labels, loss mask, infos)."""
    from gradloc.integrations.provenance import pop_sample_infos

    group = []
    for batch in loader:
        batch, infos = pop_sample_infos(batch)
        labels = batch["labels"]
        group.append((batch["input_ids"], labels, torch.ones_like(labels, dtype=torch.bool), infos))
        if len(group) == m:
            yield group
            group = []
    if group:  # the epoch's last, shorter step: every row drawn is trained on
        yield group


def train_phase(trainer: Trainer, loader: Any, mon: Any, on_step: Callable[[Any, list], None]) -> list[float]:
    """One pass of ``loader`` with ``mon`` watching; ``on_step(gradloc's StepReport, micro-batches)`` after each."""
    losses = []
    for micro in _micro_batches(loader, trainer.cfg.micro_batches):
        losses.append(trainer.step(micro, mon))
        on_step(trainer.report, micro)
    return losses


def loader_of(ds: Any, cfg: PatternsConfig, seed: int, sampler: Any = None) -> Any:
    """A torch DataLoader over the HF dataset: random order per ``seed``, provenance through the collator."""
    from torch.utils.data import DataLoader, RandomSampler
    from transformers import default_data_collator

    from gradloc.integrations.provenance import ProvenanceCollator

    sampler = sampler if sampler is not None else RandomSampler(ds, generator=torch.Generator().manual_seed(seed))
    return DataLoader(ds.with_format(None), batch_size=cfg.batch, sampler=sampler,
                      collate_fn=ProvenanceCollator(default_data_collator))


def run_seed(cfg: PatternsConfig, seed: int, workdir: Path, progress: Any = None) -> dict[str, Any]:
    from bench import patterns_data, patterns_score

    t0 = time.time()
    mix = patterns_data.pick(seed, cfg.rows_per_source, cfg.seq, cfg.fault_rate, limit=cfg.corpus_bytes)
    ds = patterns_data.dataset(mix)
    trainer = Trainer(cfg, seed)
    pre_loss = trainer.pretrain(patterns_data.held_out(mix, cfg.seq, cfg.corpus_bytes), seed)
    t_pre = time.time()
    db = str(workdir / f"seed{seed}.db")
    for stale in (db, db + "-wal", db + "-shm", str(workdir / f"quarantine-{seed}.jsonl")):
        Path(stale).unlink(missing_ok=True)  # a kept folder used again: this run's store only
    job = f"patterns-{seed}"
    mon, agent = _watch(trainer, job, db, cfg.quarantine_z)
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
    restart = patterns_score.restart(cfg, seed, mix, ds, db, workdir, trainer)
    return {"seed": seed, "faulty_sources": list(mix.faulty_sources), "faulty_rows": len(mix.faults),
            "faults_by_kind": patterns_score.count(mix.faults.values()), "rows": len(ds),
            "pretrain_loss": round(pre_loss, 3), "measured_loss_last": round(sum(losses[-20:]) / len(losses[-20:]), 3),
            "measured_steps": len(losses), "agent_dropped": dropped, "live": draws.summary(), **found, "restart": restart,
            "seconds": {"pretrain": round(t_pre - t0, 1), "measured": round(t_measured - t_pre, 1),
                        "restart": round(time.time() - t_measured, 1)}}


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
