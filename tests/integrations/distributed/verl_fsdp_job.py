"""GradlocVerlHooks on an FSDP2-sharded model in the main environment (no verl): the stand-in engine of
tests/integrations/verl_like.py (verl 0.9's FSDPEngineWithLMHead method names and signatures, ppo_loss from
verl's formulas) around a TinyGPT sharded with ``fully_shard`` over the ranks, the real ``FSDP2`` collectives
in every forward and backward. verl's own engine, DataProto and core_algos run in the real-verl tier
(tests/verl_tier); this one keeps the lockstep-probe path tested where that tier is skipped.

``plant`` = (rank, step): there, response token 2 of sample 5 (micro-batch 1, sample 1, uid u2's second
sample) has a rollout log-prob 8 nats below the trainer's — an IS weight of e^8.
"""
from __future__ import annotations

from typing import Any


def train(rank: int, world: int, steps: int, plant: tuple[int, int] | None, watched: bool) -> dict:
    import torch
    from torch.distributed.fsdp import fully_shard

    import gradloc
    from gradloc.integrations.verl import GradlocVerlHooks
    from tests.integrations.verl_like import (
        EngineWithLMHead,
        HFShaped,
        current_logp,
        loss_fn,
        make_batch,
        random_samples,
    )

    module = HFShaped(0)
    for block in module.gpt.blocks:
        fully_shard(block)
    fully_shard(module)
    engine = EngineWithLMHead(module, torch.optim.SGD(module.parameters(), lr=0.05), clip_grad=1.0)
    engine.optimizer_step = lambda: _optimizer_step(engine)  # clip_grad_norm_ of DTensor grads: a DTensor norm
    hooks = GradlocVerlHooks(engine, detector=gradloc.DetectorConfig(warmup=5), update_ratio="off",
                             store=False) if watched else None
    g = torch.Generator().manual_seed(7 + 100 * rank)
    lf = loss_fn()
    for step in range(steps):
        samples = random_samples(g)
        for s, c in zip(samples, current_logp(module, samples)):
            s.old = c
            s.rollout = [v + 0.01 * float(torch.randn((), generator=g)) for v in c]
        if plant == (rank, step):
            samples[5].rollout[2] -= 8.0
        engine.train_batch(make_batch(samples), lf)
    out: dict[str, Any] = {"grad_norms": engine.grad_norms,
                           "params": {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}}
    if hooks is not None:
        out.update(kind=hooks.mon.job.kind, probes=hooks.probes, errors=hooks.blocks.errors,
                   reports=[(r.record.global_norm, r.incident.scope if r.incident else None,
                             r.incident.localization if r.incident else None) for r in hooks.reports])
        hooks.detach()
    return out


def _optimizer_step(engine: Any) -> float:
    """FSDPEngine.optimizer_step's order (clip, skip a non-finite step, step) with its DTensor norm made whole."""
    import torch

    norm = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), max_norm=engine.optimizer_config.clip_grad)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if torch.isfinite(norm):
        engine.optimizer.step()
    else:
        engine.optimizer.zero_grad()
    return float(norm)


def fsdp1_refused(rank: int, world: int) -> str:
    """The stand-in engine around an FSDP1 (``FullyShardedDataParallel``) module: the error at attach."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    import gradloc
    from gradloc.integrations.verl import GradlocVerlHooks
    from tests.integrations.verl_like import EngineWithLMHead, HFShaped

    module = FullyShardedDataParallel(HFShaped(0), device_id=torch.device("cpu"))
    try:
        GradlocVerlHooks(EngineWithLMHead(module, torch.optim.SGD(module.parameters(), lr=0.1)), store=False)
    except gradloc.UnsupportedModelError as exc:
        return str(exc)
    return "not refused"
