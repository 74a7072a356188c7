"""The RL demo: GRPO on a verifiable arithmetic task, a planted RL culprit, detected, located and classified.

Every step samples ``n`` completions of each prompt from the policy itself (:mod:`gradloc.demo.sampler`,
vLLM-shaped outputs with the sampler's log-probs), joins them into the training layout with
:func:`gradloc.adapters.rl.join` (padded rows, or one packed row per micro-batch with ``cu_seqlens``),
scores them with the reward, normalizes the rewards within each prompt's group (GRPO's advantage) and
trains on the PPO/GRPO policy loss, per response token,

    −min(ρ·A, clip(ρ, 1 ± ε)·A) · π_old / π_rollout,    ρ = π_train / π_old,

averaged over the step's response tokens. One update per batch, so π_old is the training pass's own
π_train, detached (ρ = 1, as in TRL's GRPO with one iteration); π_rollout is the sampler's log-prob,
and π_old / π_rollout the importance weight that corrects for the engine having sampled from a
slightly different distribution (left untruncated here: truncating it, as TIS does, would bound
the planted mismatch). Each micro-batch hands its fields to ``mon.rl_fields``; the probe closure
is the same loss × a token mask.

Plants (at ``inject_step``): ``mismatch`` lowers one response token's rollout log-prob by
``mismatch`` nats in the engine's output, before the join (an engine/trainer disagreement: with
the default 8 its importance weight becomes e^8 ≈ 3000); ``advantage`` draws one completion's first
token from the policy's tail (π ≤ ``tail_prob``: a rare but legitimate draw at temperature 1) and
gives that token an advantage of ``advantage`` (a token-level advantage bug). Library code (no click):
``gradloc.agent.cli`` turns flags into a :class:`RLDemoConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from gradloc.adapters.pytorch import watch
from gradloc.adapters.rl import Rollouts, join
from gradloc.config import DetectorConfig, WatchConfig
from gradloc.demo.arith import MAX_ANSWER, PAD, PROMPT_TOKENS, VOCAB, problems, to_text
from gradloc.demo.model import GPTConfig, TinyGPT
from gradloc.demo.rl_parts import Part, grpo_advantages, make_parts, plant_mismatch, warm_start
from gradloc.demo.run import DemoResult, Planted, store_path, torch_threads
from gradloc.demo.sampler import sample
from gradloc.errors import ConfigError
from gradloc.records import StepRecord

INJECT_KINDS = ("mismatch", "advantage", "none")
WARMUP = DetectorConfig().warmup


@dataclass(frozen=True)
class RLDemoConfig:
    seed: int = 0
    steps: int = 200
    inject_step: int = 180
    inject: str = "mismatch"  # "mismatch" | "advantage" | "none"
    packed: bool = False  # one packed row per micro-batch (cu_seqlens) instead of padded rows
    prompts: int = 8  # prompts per step
    n: int = 4  # completions per prompt: the GRPO group
    micro_batches: int = 2  # gradient-accumulation micro-batches per step, each holding whole groups
    d_model: int = 64
    n_layers: int = 2
    sft_steps: int = 150  # supervised warm start: the policy starts partly right, so groups have mixed rewards
    sft_lr: float = 3e-3
    lr: float = 3e-4
    clip_epsilon: float = 0.2
    mismatch: float = 8.0  # nats taken off the planted token's rollout log-prob
    advantage: float = 50.0  # the planted token's advantage
    tail_prob: float = 0.01  # the advantage plant's token is drawn from the policy's tail: π ≤ this
    detector_alpha: float = 0.97
    incident_path: str | None = None
    job: str = "demo-rl"
    rank: int = 0
    world_size: int = 1
    agent: str | None = None
    store_path: str | None = None
    metrics_address: str | None = None
    threads: int = 1

    def __post_init__(self) -> None:
        if self.inject not in INJECT_KINDS:
            raise ConfigError(f"inject must be one of {INJECT_KINDS} with --rl, got {self.inject!r}")
        if not 0 <= self.inject_step < self.steps:
            raise ConfigError(f"inject_step must be in [0, steps={self.steps}), got {self.inject_step}")
        if self.inject_step <= WARMUP:
            raise ConfigError(f"inject_step must be >= {WARMUP + 1}: the detector warms up on the first {WARMUP} steps")
        if self.prompts < 1 or self.n < 2:
            raise ConfigError(f"need prompts >= 1 and n >= 2 completions per prompt (a group), got {self.prompts}, {self.n}")
        if not 1 <= self.micro_batches <= self.prompts:
            raise ConfigError(f"micro_batches must be in [1, prompts={self.prompts}] (whole groups per "
                              f"micro-batch), got {self.micro_batches}")
        if self.sft_steps < 0 or self.threads < 1:
            raise ConfigError(f"need sft_steps >= 0 and threads >= 1, got {self.sft_steps}, {self.threads}")
        if min(self.lr, self.sft_lr, self.clip_epsilon, self.mismatch, self.advantage) <= 0:
            raise ConfigError("lr, sft_lr, clip_epsilon, mismatch and advantage must be > 0")
        if not 0 < self.tail_prob < 1:
            raise ConfigError(f"tail_prob must be in (0, 1), got {self.tail_prob}")


@dataclass(frozen=True)
class RLPlanted(Planted):
    kind: str = "mismatch"  # "mismatch" | "advantage"


@dataclass
class RLDemoResult(DemoResult):
    rewards: list[float] = field(default_factory=list)  # each step's mean reward (fraction of correct completions)


def run_rl_demo(cfg: RLDemoConfig, on_step: Callable[[int, StepRecord], None] | None = None) -> RLDemoResult:
    with torch_threads(cfg.threads):
        return _run(cfg, on_step)


def _run(cfg: RLDemoConfig, on_step: Callable[[int, StepRecord], None] | None) -> RLDemoResult:
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = TinyGPT(GPTConfig(vocab=VOCAB, seq=PROMPT_TOKENS + MAX_ANSWER, d_model=cfg.d_model, n_layers=cfg.n_layers))
    warm_start(model, gen, cfg.sft_steps, cfg.sft_lr)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    wcfg = WatchConfig(job=cfg.job, rank=cfg.rank, world_size=cfg.world_size, incident_path=cfg.incident_path,
                       agent=cfg.agent, store_path=cfg.store_path, metrics_address=cfg.metrics_address,
                       detector=DetectorConfig(alpha=cfg.detector_alpha))
    mon = watch(model, opt, config=wcfg, decode=to_text)
    planted: list[RLPlanted] = []
    records: list[StepRecord] = []
    rewards: list[float] = []
    with mon:
        for step in range(cfg.steps):
            plant = cfg.inject if step == cfg.inject_step else "none"
            report, where, reward = _step(cfg, model, mon, gen, step, plant)
            rewards.append(reward)
            if where is not None:
                planted.append(where)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            records.append(report.record)
            if on_step is not None:
                on_step(step, report.record)
    store = store_path(mon)
    return RLDemoResult(planted, list(mon.incidents), records, to_text, store, rewards)


def _step(cfg: RLDemoConfig, model: TinyGPT, mon: Any, gen: torch.Generator, step: int,
          plant: str) -> tuple[Any, RLPlanted | None, float]:
    """One GRPO step up to ``end_step``: rollouts, join, advantages, the loss over the micro-batches."""
    batch = problems(gen, cfg.prompts)
    tail_row = int(torch.randint(0, cfg.prompts * cfg.n, (1,), generator=gen)) if plant == "advantage" else None
    outputs = sample(model, batch, cfg.n, MAX_ANSWER, gen, request_prefix=f"s{step}-",
                     tail=None if tail_row is None else (tail_row, cfg.tail_prob))
    rewards = torch.tensor([p.reward(c.token_ids) for p, o in zip(batch, outputs) for c in o.outputs])  # (S,)
    groups = torch.arange(cfg.prompts).repeat_interleave(cfg.n)  # (S,): the rows of one prompt
    adv = grpo_advantages(rewards, groups)  # (S,)
    target = plant_mismatch(outputs, adv, cfg.n, cfg.mismatch, gen) if plant == "mismatch" else None
    rollouts = join(outputs, pad_id=PAD, vocab_size=VOCAB)
    adv_tok = adv[:, None].expand_as(rollouts.loss_mask).clone()  # (S,) -> (S, L): per token
    if tail_row is not None:  # the tail token: the completion's first, scored at loss position P − 1
        target = (tail_row, rollouts.infos[tail_row].response_start)
        adv_tok[target] = cfg.advantage
    report, rows = policy_step(cfg, model, mon, rollouts, adv_tok)
    where = None if target is None else replace(_where(rollouts, rows, target, plant), rank=cfg.rank)
    return report, where, float(rewards.mean())


def policy_step(cfg: RLDemoConfig, model: TinyGPT, mon: Any, rollouts: Rollouts,
                adv_tok: torch.Tensor) -> tuple[Any, list[list[int]]]:
    """The loss over the step's micro-batches (each in its block), then ``end_step`` with the probe closure:
    the step's report and each micro-batch's rollout rows. ``adv_tok``: (S, L) per-token advantages."""
    chunks = [c.tolist() for c in torch.arange(cfg.prompts).tensor_split(cfg.micro_batches)]
    rows = [[q * cfg.n + i for q in chunk for i in range(cfg.n)] for chunk in chunks]
    parts = make_parts(rollouts, adv_tok, rows, cfg.packed)
    n_tokens = int(rollouts.loss_mask.sum())
    olds: dict[int, torch.Tensor] = {}  # π_old: the training pass's own log-probs, kept for the probes

    def loss_for(i: int, mask: torch.Tensor | None = None, fields: bool = False) -> torch.Tensor:
        return _policy_loss(model, parts[i], olds, i, cfg.clip_epsilon, n_tokens, mask, mon if fields else None)

    total = torch.zeros(())
    for i, part in enumerate(parts):
        with mon.micro_batch(**part.kwargs):
            loss = loss_for(i, fields=True)
            loss.backward()
        total += loss.detach()
    return mon.end_step(total, probe=loss_for), rows


def _policy_loss(model: TinyGPT, part: Part, olds: dict[int, torch.Tensor], i: int, eps: float, n_tokens: int,
                 mask: torch.Tensor | None, mon: Any) -> torch.Tensor:
    """Micro-batch ``i``'s share of the step's token-mean loss; ``mask`` keeps a subset of its tokens.
    One update per batch, so π_old is the first (training) pass's π_train, detached (as TRL's GRPO
    with one iteration): ρ = 1, and a probe's pass reuses it."""
    logits = model(part.input_ids, cu_seqlens=part.cu_seqlens).float()  # (B, T, V)
    logprobs = torch.log_softmax(logits, dim=-1)
    logp = logprobs.gather(-1, part.targets[..., None]).squeeze(-1)  # (B, T, V) -> (B, T)
    old = olds.setdefault(i, logp.detach())
    ratio = torch.exp(logp - old)
    is_weight = torch.where(part.mask, torch.exp(old - part.rollout_logp), 1.0)  # π_old / π_rollout; NaN off the mask
    unclipped, clipped = ratio * part.adv, ratio.clamp(1 - eps, 1 + eps) * part.adv
    terms = -torch.minimum(unclipped, clipped) * is_weight * part.mask
    if mask is not None:
        terms = terms * mask
    if mon is not None:
        entropy = -(logprobs.exp() * logprobs).sum(-1)  # (B, T, V) -> (B, T)
        mon.rl_fields(logp=logp, rollout_logp=part.rollout_logp, old_logp=old, advantages=part.adv,
                      ratio=ratio, clipped=clipped < unclipped, entropy=entropy)
    return terms.sum() / n_tokens


def _where(rollouts: Rollouts, rows: list[list[int]], target: tuple[int, int], kind: str) -> RLPlanted:
    """The planted token's (micro-batch, sample, position): the same numbers padded and packed, where
    a packed micro-batch's samples are its sequences and positions restart in each."""
    row, pos = target
    mb = next(m for m, r in enumerate(rows) if row in r)
    return RLPlanted(mb, rows[mb].index(row), pos, int(rollouts.targets[row, pos]), kind=kind)
