"""Pieces of the RL demo's step: the warm start, GRPO advantages, micro-batch layouts and the plants."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gradloc.adapters.rl import Rollouts
from gradloc.demo.arith import sft_batch
from gradloc.demo.model import TinyGPT, token_losses


def warm_start(model: TinyGPT, gen: torch.Generator, steps: int, lr: float, batch: int = 64) -> None:
    """Supervised steps on correct answers (before gradloc is attached), so that the policy starts
    partly right: groups then have mixed rewards and non-zero advantages from the first RL step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        x, y, mask = sft_batch(gen, batch)
        loss = (token_losses(model(x), y) * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(S,) rewards -> (S,) advantages: each reward minus its group's mean, over the group's std
    (GRPO; a group whose rewards are all equal gets 0)."""
    adv = torch.zeros_like(rewards)
    for g in groups.unique():
        sel = groups == g
        r = rewards[sel]
        adv[sel] = (r - r.mean()) / (r.std() + eps)
    return adv


@dataclass(frozen=True)
class Part:
    """One micro-batch in the training layout: padded (B, T), or packed (1, N) with ``cu_seqlens``."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor  # bool: the response tokens' loss positions
    rollout_logp: torch.Tensor  # the sampler's log-prob of each target (NaN off the mask)
    adv: torch.Tensor  # per token
    cu_seqlens: torch.Tensor | None
    kwargs: dict[str, Any]  # for mon.micro_batch(...)


def make_parts(rollouts: Rollouts, adv_tok: torch.Tensor, rows: Sequence[Sequence[int]], packed: bool) -> list[Part]:
    """The micro-batches of ``rows`` (row indices of ``rollouts`` each); ``adv_tok`` (S, L) per token."""
    parts = []
    for idx in rows:
        sub = rollouts.rows(list(idx))
        if packed:
            p = sub.packed()
            adv = torch.cat([adv_tok[r, :n] for r, n in zip(idx, sub.lengths)])[None]  # (n_i,) each -> (1, N)
            parts.append(Part(p.input_ids, p.targets, p.loss_mask, p.rollout_logp, adv, p.cu_seqlens,
                              p.micro_batch_kwargs()))
        else:
            adv = adv_tok[list(idx), : sub.input_ids.shape[1]]  # (S, L) -> (B, T)
            parts.append(Part(sub.input_ids, sub.targets, sub.loss_mask, sub.rollout_logp, adv, None,
                              sub.micro_batch_kwargs()))
    return parts


def plant_mismatch(outputs: Sequence[Any], adv: torch.Tensor, n: int, nats: float,
                   gen: torch.Generator) -> tuple[int, int]:
    """Lower one sampled token's log-prob by ``nats`` in the engine's output (before the join): the
    least likely token of a random completion with a non-zero advantage (a token with no advantage
    has no gradient to inflate). Returns its (row, loss position) in the joined rows."""
    live = (adv != 0).nonzero().flatten()
    pool = live if live.numel() else torch.arange(adv.numel())
    row = int(pool[torch.randint(0, pool.numel(), (1,), generator=gen)])
    out, comp = outputs[row // n], outputs[row // n].outputs[row % n]
    k = min(range(len(comp.token_ids)), key=lambda j: comp.logprobs[j][comp.token_ids[j]].logprob)
    entry = comp.logprobs[k][comp.token_ids[k]]
    entry.logprob -= nats
    comp.cumulative_logprob -= nats
    return row, len(out.prompt_token_ids) - 1 + k  # position p scores token p + 1
