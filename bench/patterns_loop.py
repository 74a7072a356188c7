"""The training loop of ``python -m bench patterns`` (bench/patterns.py): its config, the user's model and optimizer,
gradloc watching with an in-process agent core that quarantines by policy, and the DataLoader over the HF mixture.

The loop is what a user writes: a ``DataLoader`` over the ``datasets`` mixture with ``ProvenanceCollator``, the
infos popped off each batch (``pop_sample_infos``) and given to ``mon.micro_batch(..., loss_mask=...,
sample_infos=...)``, ``end_step`` with the probe closure, clipping, AdamW. Pre-training runs the same step without
gradloc. One LR schedule (linear warm-up, cosine to 10%) runs over pre-training, the measured epochs and the
restart epoch, as one long run would.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

EPOCH_SEED = 1_000_003


@dataclass(frozen=True)
class PatternsConfig:
    """The benchmark's sizes: the issue's byte-level GPT-2 (samples_text's), 2 micro-batches of 8 × 128 bytes a step
    (16 rows), 300 rows per source (an epoch is 75 steps), 4% faulty rows; the default judge and detector."""

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


def watch_with_agent(trainer: Trainer, job: str, db: str, quarantine_z: float) -> tuple[Any, Any]:
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
