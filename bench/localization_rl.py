"""RL scenarios for ``python -m bench localization --rl``: planted RL culprits, located and classified.

A TinyGPT (the localization bench's) is first trained supervised on the demo corpus until it is
confident, then run for ``rl_warmup`` healthy GRPO-style steps so the detector learns what a healthy
RL step looks like. Every RL step treats each sample's loss positions as a sampled response:
log π_train from the model; π_old = the same values detached (one PPO epoch); π_rollout = π_old plus
small engine noise (σ = ``engine_noise``); advantages per sample ~ N(0, 1); loss
−min(ρA, clip(ρ, 1 ± 0.2)A) · (π_old / π_rollout) summed over loss tokens / tokens, the RL fields
handed to ``mon.rl_fields``. Then, from one snapshot of model, optimizer and detector, for every
scenario × seed: one fresh step with the plant, through ``mon.end_step(loss, probe=...)``.

Scenarios:

- ``mismatch``: one loss token's rollout log-prob 8 below the trainer's (its IS weight ~3,000) →
  ``train_inference_mismatch``; its sample's advantage is at least 1 RMS in magnitude (sign kept): a
  mismatch token of a sample with A ≈ 0 moves no gradient, so there is no spike to localize (the
  first 5-seed run had one such step, with no incident);
- ``low_prob_adv``: a sampled token the policy found very unlikely: one loss position's target is
  replaced by the model's least likely token there (the engine agrees on its probability: no
  mismatch), and that token gets advantage ``advantage`` (5× the advantages' RMS; per-token, as PPO
  with GAE gives: a GRPO-style sample-wide 5× advantage makes every token of the sample a large-
  advantage token, which gradloc then names too, docs/BENCHMARKS.md §2.1); its ratio stays
  unclipped → ``low_prob_high_advantage``;
- ``two_samples``: two mismatch tokens in two different samples (different micro-batches);
- ``packed``: a mismatch token in a step whose micro-batches are packed rows (the samples back to
  back, ``cu_seqlens``; TinyGPT attends within each sequence): reported per sequence.

Metrics: recall and precision of the planted (micro-batch, sample, position) keys, probes, and
whether each found culprit got the planted class.
"""
from __future__ import annotations

import copy
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

import gradloc
from bench import torch_threads
from gradloc.config import DetectorConfig, WatchConfig
from gradloc.demo.data import cl100k_corpus
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses

SCENARIOS = ("mismatch", "low_prob_adv", "two_samples", "packed")
EXPECTED = {"mismatch": "train_inference_mismatch", "low_prob_adv": "low_prob_high_advantage",
            "two_samples": "train_inference_mismatch", "packed": "train_inference_mismatch"}
EPS = 0.2


@dataclass(frozen=True)
class RLBenchConfig:
    seeds: int = 5
    train_steps: int = 120  # supervised, until the model is confident
    rl_warmup: int = 40  # healthy RL steps: the detector's baseline
    micro_batches: int = 4
    batch: int = 8
    seq: int = 64
    prompt: int = 8
    d_model: int = 64
    n_layers: int = 2
    lr: float = 6e-3
    rl_lr: float = 1e-4
    engine_noise: float = 0.01
    advantage: float = 5.0
    seed: int = 0
    threads: int | None = 1

    @staticmethod
    def quick() -> "RLBenchConfig":
        return RLBenchConfig(seeds=1, train_steps=80, rl_warmup=30, batch=4)


class _RLBench:
    def __init__(self, cfg: RLBenchConfig) -> None:
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.corpus = cl100k_corpus()
        self.model = TinyGPT(GPTConfig(vocab=self.corpus.vocab, seq=cfg.seq * cfg.batch, d_model=cfg.d_model,
                                       n_layers=cfg.n_layers))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.mon = gradloc.watch(self.model, self.opt, decode=self.corpus.to_text, config=WatchConfig(
            job="bench-rl", embedded=False, update_ratio="off", detector=DetectorConfig(alpha=0.9)))
        self.mask = torch.ones(cfg.batch, cfg.seq, dtype=torch.bool)
        self.mask[:, : cfg.prompt] = False
        self.n_tokens = cfg.micro_batches * cfg.batch * (cfg.seq - cfg.prompt)
        self.gen = torch.Generator().manual_seed(cfg.seed)

    def pretrain(self) -> float:
        loss = torch.zeros(())
        for _ in range(self.cfg.train_steps):
            for _ in range(self.cfg.micro_batches):
                x, y = self.corpus.batch(self.gen, self.cfg.batch, self.cfg.seq)
                loss = (token_losses(self.model(x), y) * self.mask).sum() / self.n_tokens
                loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.rl_lr
        return float(loss) * self.cfg.micro_batches

    # -- one RL step ------------------------------------------------------------------------------
    def batch(self, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
        c = self.cfg
        out = []
        for _ in range(c.micro_batches):
            x, y = self.corpus.batch(gen, c.batch, c.seq)
            with torch.no_grad():
                logp = -token_losses(self.model(x), y)  # (B, T)
            rollout = logp + c.engine_noise * torch.randn(logp.shape, generator=gen)
            adv = torch.randn(c.batch, generator=gen)[:, None].expand(c.batch, c.seq).clone()  # per sample
            out.append({"x": x, "y": y, "old": logp.clone(), "rollout": rollout, "adv": adv, "logp0": logp})
        return out

    def step(self, mbs: list[dict[str, torch.Tensor]], packed: bool = False) -> gradloc.StepReport:
        c = self.cfg
        cu = torch.arange(0, c.batch * c.seq + 1, c.seq) if packed else None

        def loss_for(i: int, mask: torch.Tensor | None = None, fields: bool = False) -> torch.Tensor:
            mb = mbs[i]
            shape = (1, c.batch * c.seq) if packed else (c.batch, c.seq)
            x, y = mb["x"].reshape(shape), mb["y"].reshape(shape)  # (B, T) -> (1, B·T) when packed
            logp = -token_losses(self.model(x, cu) if packed else self.model(x), y)
            old, rollout, adv = (mb[k].reshape(shape) for k in ("old", "rollout", "adv"))
            ratio = torch.exp(logp - old)
            terms = -torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv) * torch.exp(old - rollout)
            m = self.mask.reshape(shape)
            terms = terms * m if mask is None else terms * m * mask
            if fields:
                clipped = ratio.clamp(1 - EPS, 1 + EPS) * adv < ratio * adv
                self.mon.rl_fields(logp=logp, old_logp=old, rollout_logp=rollout, advantages=adv, ratio=ratio,
                                   clipped=clipped)
            return terms.sum() / self.n_tokens

        total = torch.zeros(())
        for i, mb in enumerate(mbs):
            shape = (1, c.batch * c.seq) if packed else (c.batch, c.seq)
            ids = [f"r{i}-{b}" for b in range(c.batch)]
            extra = {"cu_seqlens": cu} if packed else {}
            with self.mon.micro_batch(mb["y"].reshape(shape), loss_mask=self.mask.reshape(shape), sample_ids=ids, **extra):
                loss = loss_for(i, fields=True)
                loss.backward()
            total += loss.detach()
        return self.mon.end_step(total, probe=loss_for)

    def rl_warmup(self) -> int:
        incidents = 0
        for _ in range(self.cfg.rl_warmup):
            rep = self.step(self.batch(self.gen))
            incidents += rep.incident is not None
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return incidents

    # -- scenarios --------------------------------------------------------------------------------
    def plant(self, name: str, mbs: list[dict[str, torch.Tensor]], gen: torch.Generator) -> list[tuple[int, int, int]]:
        c = self.cfg

        def pos() -> int:
            return int(torch.randint(c.prompt, c.seq, (1,), generator=gen))

        picks = torch.randperm(c.micro_batches, generator=gen).tolist()
        if name in ("mismatch", "packed", "two_samples"):
            keys = [(m, int(torch.randint(0, c.batch, (1,), generator=gen)), pos())
                    for m in picks[: 2 if name == "two_samples" else 1]]
            for m, b, t in keys:
                mbs[m]["rollout"][b, t] -= 8.0
                adv = mbs[m]["adv"][b]  # (T,): the sample's advantage at every position
                a = float(adv[t])
                adv[:] = math.copysign(max(abs(a), 1.0), a)  # |A| ≥ 1 RMS: with A ≈ 0 the token moves no gradient
            return sorted(keys)
        m, b, t = picks[0], int(torch.randint(0, c.batch, (1,), generator=gen)), pos()
        mb = mbs[m]
        with torch.no_grad():
            logp_all = torch.log_softmax(self.model(mb["x"][b:b + 1])[0, t].float(), -1)  # (V,)
        tok = int(logp_all.argmin())
        mb["y"] = mb["y"].clone()
        mb["y"][b, t] = tok
        for k in ("old", "rollout", "logp0"):
            mb[k][b, t] = float(logp_all[tok])  # sampled at that probability; the engine agrees
        mb["adv"][b, t] = c.advantage  # this token's advantage (per-token, as PPO with GAE gives)
        return [(m, b, t)]

    def scenario(self, name: str, seed: int, snap: dict[str, Any]) -> dict[str, Any]:
        self.model.load_state_dict(snap["model"])
        self.opt.load_state_dict(copy.deepcopy(snap["opt"]))
        self.mon.detector = copy.deepcopy(snap["detector"])
        self.opt.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(20_000 + 101 * seed + SCENARIOS.index(name))
        mbs = self.batch(gen)
        planted = self.plant(name, mbs, gen)
        rep = self.step(mbs, packed=name == "packed")
        loc = rep.incident.localization if rep.incident else None
        found = [(cu.micro_batch, cu.sample, cu.position) for cu in loc.culprits] if loc else []
        classes = {(cu.micro_batch, cu.sample, cu.position): cu.classification.kind
                   for cu in (loc.culprits if loc else ()) if cu.classification is not None}
        return {"scenario": name, "seed": seed, "planted": [list(k) for k in planted], "detected": rep.spike.is_spike,
                "kinds": list(rep.spike.kinds), "status": loc.status if loc else "no incident",
                "probes": loc.probes if loc else 0, "culprits": [list(k) for k in found],
                "found": len(set(planted) & set(found)),
                "classified_right": sum(classes.get(k) == EXPECTED[name] for k in planted),
                "incident_class": rep.incident.classification.kind if rep.incident and rep.incident.classification else None}


def run_rl_localization(cfg: RLBenchConfig, progress: Any = None) -> dict[str, Any]:
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with torch_threads(cfg.threads):
        bench = _RLBench(cfg)
        final_sft_loss = bench.pretrain()
        warm_incidents = bench.rl_warmup()
        snap = {"model": copy.deepcopy(bench.model.state_dict()), "opt": copy.deepcopy(bench.opt.state_dict()),
                "detector": copy.deepcopy(bench.mon.detector)}
        rows = []
        for seed in range(cfg.seeds):
            for name in SCENARIOS:
                rows.append(bench.scenario(name, seed, snap))
                if progress is not None:
                    r = rows[-1]
                    progress(len(rows) - 1, cfg.seeds * len(SCENARIOS),
                             f"{name}/{seed}: {r['found']}/{len(r['planted'])} in {r['probes']} probes, {r['status']}, "
                             f"class {r['incident_class']}")
        bench.mon.close()
    planted = sum(len(r["planted"]) for r in rows)
    found = sum(r["found"] for r in rows)
    reported = sum(len(r["culprits"]) for r in rows)
    per = {name: {"recall": _ratio(sum(r["found"] for r in rs), sum(len(r["planted"]) for r in rs)),
                  "precision": _ratio(sum(r["found"] for r in rs), sum(len(r["culprits"]) for r in rs)),
                  "classified": _ratio(sum(r["classified_right"] for r in rs), sum(len(r["planted"]) for r in rs)),
                  "probes_max": max(r["probes"] for r in rs)}
           for name in SCENARIOS for rs in [[r for r in rows if r["scenario"] == name]]}
    return {"recall": _ratio(found, planted), "precision": _ratio(found, reported),
            "classified": _ratio(sum(r["classified_right"] for r in rows), planted),
            "probes_max": max(r["probes"] for r in rows), "probes_median": statistics.median(r["probes"] for r in rows),
            "spikes": sum(r["detected"] for r in rows), "runs": len(rows), "planted": planted, "per_scenario": per,
            "scenarios": rows, "setup": {"final_sft_loss": final_sft_loss, "rl_warmup_incidents": warm_incidents,
                                         "micro_batches": cfg.micro_batches, "batch": cfg.batch, "seq": cfg.seq,
                                         "seeds": cfg.seeds, "advantage": cfg.advantage,
                                         "engine_noise": cfg.engine_noise},
            "wall_s": round(time.perf_counter() - t0, 1), "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


def format_table(res: dict[str, Any]) -> str:
    lines = ["scenario      recall  precision  classified  probes max"]
    for name, p in res["per_scenario"].items():
        lines.append(f"{name:13s} {p['recall']!s:7s} {p['precision']!s:10s} {p['classified']!s:11s} {p['probes_max']}")
    lines.append(f"\nall: recall {res['recall']} precision {res['precision']} classified {res['classified']} "
                 f"probes median {res['probes_median']} max {res['probes_max']}; {res['spikes']}/{res['runs']} "
                 f"steps flagged; {res['wall_s']} s")
    return "\n".join(lines)
