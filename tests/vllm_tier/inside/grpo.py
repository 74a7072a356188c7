"""The tier's GRPO step on real vLLM rollouts, shared by test_grpo.py and test_persistent.py.

Rollouts: 8 prompts × n=``N`` completions × ≤``MAX_TOKENS`` tokens from the session's engine, joined by
``gradloc.adapters.rl.join``. Advantages: the reward (:func:`reward`) normalised within each prompt's group
(:func:`grpo_advantages`). Loss (:func:`policy_loss`): token-mean PPO-clip −min(ρ·A, clip(ρ, 1 ± ε)·A) · w with
ρ = π_train / π_old (old = the trainer's own detached log-probs: one update per batch, so ρ = 1) and the
untruncated importance weight w = π_old / π_rollout that corrects for the engine's numerics. One step
(:func:`grpo_step`): ``MICRO_BATCHES`` micro-batches under ``mon.micro_batch``, ``mon.rl_fields`` on each, the
same loss × token mask as the probe closure, ``mon.end_step``. See tests/vllm_tier/README.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gradloc.adapters.rl import join
from tests.vllm_tier.inside import engine

N = 4  # completions per prompt (the GRPO group)
MAX_TOKENS = 16
MICRO_BATCHES = 2  # 32 rows -> 2 micro-batches of 16 (4 prompt groups each)
EPS = 0.2  # PPO clip range


def reward(c) -> float:
    """1 − 0.5·len/MAX_TOKENS for a completion that stopped on EOS (shorter is better), −0.5 when cut."""
    return 1.0 - 0.5 * len(c.token_ids) / MAX_TOKENS if c.finish_reason == "stop" else -0.5


def grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(S,) rewards -> (S,) advantages normalised within each group (GRPO; unbiased std, as TRL)."""
    adv = torch.zeros_like(rewards)
    for g in groups.unique():
        rows = groups == g
        adv[rows] = (rewards[rows] - rewards[rows].mean()) / (rewards[rows].std() + 1e-4)
    return adv


@dataclass
class Batch:
    """One step's rollouts: the real RequestOutputs, the join, and the GRPO advantages."""

    outs: list
    rollouts: object
    advantages: torch.Tensor  # (S,)
    planted: tuple | None = None  # (row, response token index) of the corrupted logprob


def make_batch(outs, tokenizer) -> Batch:
    ro = join(outs, pad_id=tokenizer.pad_token_id, vocab_size=len(tokenizer), max_length=engine.MAX_MODEL_LEN)
    rewards = torch.tensor([reward(c) for o in outs for c in o.outputs])  # join order: request, then completion
    return Batch(outs, ro, grpo_advantages(rewards, ro.groups))


def sample_batch(llm, tokenizer, seed: int) -> Batch:
    """One step's rollouts (T=1, ``logprobs=0``, engine seed ``seed``), joined, with their advantages."""
    outs = engine.rollouts(llm, engine.PROMPTS, n=N, max_tokens=MAX_TOKENS, logprobs=0, seed=seed)
    return make_batch(outs, tokenizer)


def micro_batches(ro, layout: str) -> list:
    S = len(ro.sample_ids)
    size = S // MICRO_BATCHES
    mbs = [ro.rows(slice(i * size, (i + 1) * size)) for i in range(MICRO_BATCHES)]
    return [mb.packed() for mb in mbs] if layout == "packed" else mbs


def token_logp(model, mb, layout: str) -> torch.Tensor:
    """log π_train of each position's target, (B, T) padded or (1, N) packed."""
    if layout == "packed":  # block-diagonal attention from restarting position ids; needs no attention mask, no cache
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
    else:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask.long(), use_cache=False).logits
    return logits.float().log_softmax(-1).gather(-1, mb.targets[..., None]).squeeze(-1)  # (B, T, V) -> (B, T)


def per_token(adv: torch.Tensor, mb, layout: str) -> torch.Tensor:
    if layout == "packed":
        return torch.repeat_interleave(adv, mb.cu_seqlens.diff())[None]  # (S,) -> (1, N)
    return adv[:, None].expand(mb.loss_mask.shape)  # (B,) -> (B, T)


def policy_loss(model, mb, adv: torch.Tensor, n_loss, layout: str, token_mask=None, mon=None,
                out: list | None = None) -> torch.Tensor:
    """The micro-batch's share of the step's token-mean GRPO loss; ``token_mask`` (same shape as the rows)
    keeps only some positions' terms (the probe's mask, or a ground truth's), ``mon`` gets the RL fields,
    ``out`` the detached log π_train."""
    logp = token_logp(model, mb, layout)
    old = logp.detach()
    rollout = torch.where(mb.loss_mask, mb.rollout_logp, old)  # NaN off the loss positions
    a = per_token(adv, mb, layout)
    ratio = torch.exp(logp - old)
    unclipped, clipped = ratio * a, ratio.clamp(1 - EPS, 1 + EPS) * a
    terms = -torch.minimum(unclipped, clipped) * torch.exp(old - rollout) * mb.loss_mask
    if token_mask is not None:
        terms = terms * token_mask
    if mon is not None:
        mon.rl_fields(logp=logp, rollout_logp=mb.rollout_logp, old_logp=old, advantages=adv, ratio=ratio,
                      clipped=clipped < unclipped)
    if out is not None:
        out.append(old)
    return terms.sum() / n_loss


def grpo_step(model, mon, batch: Batch, layout: str):
    """One GRPO step on ``batch`` under ``mon`` (gradients left in the model's ``.grad``); returns (the step's
    report, the micro-batches, their detached log π_train)."""
    ro = batch.rollouts
    mbs = micro_batches(ro, layout)
    size = len(ro.sample_ids) // MICRO_BATCHES
    advs = [batch.advantages[i * size:(i + 1) * size] for i in range(MICRO_BATCHES)]
    n_loss = ro.loss_mask.sum()  # token-mean over the whole step

    def probe(i, token_mask=None):
        return policy_loss(model, mbs[i], advs[i], n_loss, layout, token_mask)

    total, logps = torch.zeros(()), []
    for i, mb in enumerate(mbs):
        with mon.micro_batch(**mb.micro_batch_kwargs()):
            loss = policy_loss(model, mb, advs[i], n_loss, layout, mon=mon, out=logps)
            loss.backward()
        total += loss.detach()
    return mon.end_step(total, probe=probe), mbs, logps
