"""Localization accuracy and probe cost on planted culprits: gradloc vs GradLoc-style bisection.

A TinyGPT is trained on the demo corpus (cl100k-tokenized sentence cycle, the first ``prompt``
positions of every sample masked from the loss) with the monitor attached, until it is confident;
the detector is warmed up on that healthy run. Then model, optimizer and detector state are
snapshotted, and for every scenario × seed: restore, build one step of fresh data (seeded), plant
the culprits, run the step through the monitor (``mon.end_step(loss, probe=...)``) and record what
gradloc localized. On the same step (same data, same model state, training gradients kept aside
by a ProbeSession) the GradLoc-style baseline runs twice: worst micro-batch only, and all hot
micro-batches.

Scenarios (weights are per-token loss weights; every other loss position has weight 1):

- ``single``: one advantage culprit: a uniformly random loss position gets weight ``advantage``
  (an RL-style huge advantage × ratio on an ordinary, well-predicted token);
- ``three_mb``: three such culprits, in three different micro-batches;
- ``label``: the demo's corrupted label: where the model is surest, the target is replaced by the
  token it finds least likely (target only; weight 1);
- ``advantage``: the demo's advantage culprit: the least likely target of a random sample gets
  weight ``advantage``;
- ``diffuse``: no culprit at all: every loss weight of the step × ``diffuse_factor`` (a spike no
  token set explains, like a loss-scale or learning-rate blow-up). Nothing is planted, so any token
  a method names is a false positive; what counts is the status, the probes and the sample picture.

The advantage weight is the bench's own choice: 5000 per 896 loss tokens, scaled with the number
of loss tokens per step (the loss is normalised by it). That is ~17× the demo's relative strength
(the demo plants 300 per 896): a strong culprit, far above what the detector needs, so the
benchmark compares how methods *locate* a spike rather than whether it is flagged.
"""
from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

import gradloc
from bench import torch_threads
from bench.bisection_baseline import BaselineResult, gradloc_bisection
from bench.localization_summary import summarize
from gradloc.collector.batch import make_meta
from gradloc.config import DetectorConfig, WatchConfig
from gradloc.demo.data import Corpus, cl100k_corpus
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses
from gradloc.demo.run import DemoConfig, _plant

SCENARIOS = ("single", "three_mb", "label", "advantage", "diffuse")
Key = tuple[int, int, int]


@dataclass(frozen=True)
class LocalizationConfig:
    seeds: int = 5
    train_steps: int = 150
    micro_batches: int = 4
    batch: int = 16
    seq: int = 64
    prompt: int = 8
    d_model: int = 64
    n_layers: int = 2
    lr: float = 6e-3
    detector_alpha: float = 0.9  # as the demo: a short run, the EMA must forget the steep start
    advantage: float | None = None  # None: 5000 × loss tokens per step / 896 (~17× the demo's 300 / 896)
    diffuse_factor: float = 30.0  # the diffuse scenario: every loss weight of the step × this
    kappa: float = 4.0  # baseline's τ = κ·σ·√n (gradloc's own bisection_sigma default)
    baseline_budget: int = 512
    seed: int = 0
    threads: int | None = 1  # tiny model: one thread is as fast and robust on a busy 2-core machine
    scenarios: tuple[str, ...] = SCENARIOS

    @staticmethod
    def quick() -> LocalizationConfig:
        return LocalizationConfig(seeds=1, train_steps=120, batch=4)

    @property
    def loss_tokens(self) -> int:
        return self.micro_batches * self.batch * (self.seq - self.prompt)

    @property
    def advantage_weight(self) -> float:
        return self.advantage if self.advantage is not None else 5000.0 * self.loss_tokens / 896


class _Bench:
    def __init__(self, cfg: LocalizationConfig) -> None:
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.corpus: Corpus = cl100k_corpus()
        self.model = TinyGPT(GPTConfig(vocab=self.corpus.vocab, seq=cfg.seq, d_model=cfg.d_model,
                                       n_layers=cfg.n_layers))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.mon = gradloc.watch(self.model, self.opt, decode=self.corpus.to_text,
                                 config=WatchConfig(job="bench", embedded=False,
                                                    detector=DetectorConfig(alpha=cfg.detector_alpha)))
        self.loss_mask = torch.ones(cfg.batch, cfg.seq, dtype=torch.bool)
        self.loss_mask[:, : cfg.prompt] = False
        self.demo_cfg = DemoConfig(micro_batches=1, batch=cfg.batch, seq=cfg.seq, prompt=cfg.prompt,
                                   advantage=cfg.advantage_weight, steps=1000, inject_step=100)

    # -- one step -------------------------------------------------------------------------------
    def closure(self, batches: list, weights: torch.Tensor) -> Callable[..., torch.Tensor]:
        n = self.cfg.loss_tokens

        def loss_for(i: int, mask: torch.Tensor | None = None) -> torch.Tensor:
            x, y = batches[i]
            w = weights[i] if mask is None else weights[i] * mask
            return (token_losses(self.model(x), y) * w).sum() / n

        return loss_for

    def step(self, batches: list, weights: torch.Tensor, tag: str) -> tuple[gradloc.StepReport, Callable]:
        loss_for = self.closure(batches, weights)
        total = torch.zeros(())
        for i, (_, y) in enumerate(batches):
            ids = [f"{tag}-{i}-{b}" for b in range(self.cfg.batch)]
            with self.mon.micro_batch(y, loss_mask=self.loss_mask, sample_ids=ids):
                loss = loss_for(i)
                loss.backward()
            total += loss.detach()
        return self.mon.end_step(total, probe=loss_for), loss_for

    def fresh(self, gen: torch.Generator) -> tuple[list, torch.Tensor]:
        c = self.cfg
        batches = [self.corpus.batch(gen, c.batch, c.seq) for _ in range(c.micro_batches)]
        weights = self.loss_mask.float().expand(c.micro_batches, -1, -1).clone()  # (M, B, T)
        return batches, weights

    # -- training ---------------------------------------------------------------------------------
    def train(self, progress: Any) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(self.cfg.seed)
        losses, incidents = [], 0
        t0 = time.perf_counter()
        for s in range(self.cfg.train_steps):
            batches, weights = self.fresh(gen)
            report, _ = self.step(batches, weights, f"train{s}")
            incidents += report.incident is not None
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append(report.record.loss)
            if progress is not None and (s % 25 == 0 or s == self.cfg.train_steps - 1):
                progress(s, self.cfg.train_steps, f"train loss {report.record.loss:.4f} "
                                                  f"norm {report.record.global_norm:.4f}")
        return {"train_steps": self.cfg.train_steps, "final_loss": losses[-1],
                "train_incidents": incidents, "train_s": round(time.perf_counter() - t0, 1),
                "healthy_norm": self.mon.detector.healthy_norm(), "healthy_loss": self.mon.detector.healthy_loss()}

    # -- planting -----------------------------------------------------------------------------------
    def plant(self, scenario: str, batches: list, weights: torch.Tensor, gen: torch.Generator) -> list[Key]:
        c = self.cfg
        if scenario == "diffuse":
            weights *= c.diffuse_factor  # (M, B, T): every loss position, prompt positions stay 0
            return []
        if scenario in ("single", "three_mb"):
            k = 1 if scenario == "single" else 3
            mbs = torch.randperm(c.micro_batches, generator=gen)[:k].tolist()
            out = []
            for m in mbs:
                b = int(torch.randint(0, c.batch, (1,), generator=gen))
                t = int(torch.randint(c.prompt, c.seq, (1,), generator=gen))
                weights[m, b, t] = c.advantage_weight
                out.append((m, b, t))
            return sorted(out)
        # the demo's culprits, planted in a random micro-batch by the demo's own _plant
        m = int(torch.randint(0, c.micro_batches, (1,), generator=gen))
        sub = [batches[m]]
        p = _plant(replace(self.demo_cfg, inject=scenario), self.model, sub, weights[m:m + 1], gen)
        batches[m] = sub[0]  # a corrupted label replaces the (cloned) labels tensor
        return [(m, p.sample, p.position)]

    # -- scenarios ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {"model": copy.deepcopy(self.model.state_dict()), "opt": copy.deepcopy(self.opt.state_dict()),
                "detector": copy.deepcopy(self.mon.detector)}

    def restore(self, snap: dict[str, Any]) -> None:
        self.model.load_state_dict(snap["model"])
        self.opt.load_state_dict(copy.deepcopy(snap["opt"]))
        self.mon.detector = copy.deepcopy(snap["detector"])
        self.opt.zero_grad(set_to_none=True)

    def scenario(self, name: str, seed: int) -> dict[str, Any]:
        c = self.cfg
        gen = torch.Generator().manual_seed(10_000 + 101 * seed + SCENARIOS.index(name))
        batches, weights = self.fresh(gen)
        planted = self.plant(name, batches, weights, gen)
        report, loss_for = self.step(batches, weights, f"{name}{seed}")
        spike, inc = report.spike, report.incident
        loc = inc.localization if inc is not None else None
        reported: list[Key] = [(cc.micro_batch, cc.sample, cc.position) for cc in loc.culprits] if loc else []
        row: dict[str, Any] = {
            "scenario": name, "seed": seed, "planted": [list(k) for k in planted],
            "detected": spike.is_spike, "kinds": list(spike.kinds),
            "global_norm": report.record.global_norm, "healthy_norm": spike.mean, "z": spike.z,
            "loss": report.record.loss, "healthy_loss": spike.loss_mean, "loss_z": spike.loss_z,
        }
        row["planted_rel_score"] = _planted_rel_scores(report.record, planted)
        row["gradloc"] = {
            "status": loc.status if loc else "no incident" if inc is None else "not localized",
            "method": loc.method if loc else None,
            "culprits": [list(k) for k in reported],
            "found": len(set(planted) & set(reported)),
            "probes": loc.probes if loc else 0,
            "explained_share": loc.explained_share if loc else None,
            "loss_share": loc.loss_share if loc else None,
            "norm_without_culprits": loc.norm_without_culprits if loc else None,
            # ‖∇ − ∇_C‖ / healthy norm: ≫ 1 means the rest of the step would still be a spike
            "residual_over_healthy": (loc.norm_without_culprits / spike.mean
                                      if loc and loc.norm_without_culprits is not None and spike.mean else None),
            "note": loc.note if loc else "",
            "top_sample_share": max((x.share for x in loc.samples if x.share is not None), default=None) if loc else None,
        }
        # the baseline on the same step: same data, same model state; gradients restored afterwards
        healthy = spike.mean if spike.mean else report.record.global_norm
        metas = [make_meta(i, y, self.loss_mask, None, None) for i, (_, y) in enumerate(batches)]
        before = [p.grad for p in self.mon.layer_stats.params]
        for key, worst_only in (("bisection", True), ("bisection_all", False)):
            res: BaselineResult = gradloc_bisection(
                self.model, self.mon.layer_stats.params, metas, [self.loss_mask] * c.micro_batches, loss_for,
                healthy, c.kappa, worst_only=worst_only, budget=c.baseline_budget, suspend=self.mon.pause_token_hooks)
            row[key] = {"culprits": [list(k) for k in res.culprits],
                        "found": len(set(planted) & set(res.culprits)), "probes": res.probes,
                        "exhausted": res.exhausted, "hot_micro_batches": res.hot_micro_batches}
        row["grads_restored"] = all(a is b for a, b in zip(before, (p.grad for p in self.mon.layer_stats.params)))
        return row


def _planted_rel_scores(record: Any, planted: list[Key]) -> list[float | None]:
    """Each planted culprit's attribution score in the LM-head layer (the layer gradloc ranks
    candidates by) relative to the step's top head score, from the record's top-k tokens (None:
    not in the top k). gradloc keeps candidates whose score is >= candidate_rel_score (0.1) × top."""
    if record.tokens is None:
        return [None] * len(planted)
    head = {}
    for t in record.tokens.top:
        share = next((ls.share for ls in t.layers if ls.layer == "head"), 0.0)
        head[(t.micro_batch, t.sample, t.position)] = t.score * share
    top = max(head.values(), default=0.0)
    return [round(head[k] / top, 4) if k in head and top > 0 else None for k in planted]


def run_localization(cfg: LocalizationConfig, progress: Any = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    with torch_threads(cfg.threads):
        threads_used = torch.get_num_threads()
        bench = _Bench(cfg)
        training = bench.train(progress)
        snap = bench.snapshot()
        rows = []
        for seed in range(cfg.seeds):
            for name in cfg.scenarios:
                bench.restore(snap)
                rows.append(bench.scenario(name, seed))
                if progress is not None:
                    r = rows[-1]
                    progress(len(rows) - 1, cfg.seeds * len(cfg.scenarios),
                             f"{name}/{seed}: kinds={r['kinds']} gradloc {r['gradloc']['found']}/{len(r['planted'])} "
                             f"in {r['gradloc']['probes']} probes ({r['gradloc']['status']}), bisection "
                             f"{r['bisection']['found']} in {r['bisection']['probes']}, all-hot "
                             f"{r['bisection_all']['found']} in {r['bisection_all']['probes']}")
        bench.mon.close()
    return {
        **summarize(rows, cfg),
        "scenarios": rows,
        "setup": {
            "micro_batches": cfg.micro_batches, "batch": cfg.batch, "seq": cfg.seq, "prompt": cfg.prompt,
            "tokens_per_micro_batch": cfg.batch * cfg.seq, "loss_tokens_per_step": cfg.loss_tokens,
            "d_model": cfg.d_model, "n_layers": cfg.n_layers, "vocab": bench.corpus.vocab, "lr": cfg.lr,
            "advantage_weight": cfg.advantage_weight, "detector_alpha": cfg.detector_alpha,
            "seeds": cfg.seeds, "torch_threads": threads_used, "torch_version": torch.__version__,
            **training,
        },
        "wall_s": round(time.perf_counter() - t0, 1),
        "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],  # at start, at end
    }


