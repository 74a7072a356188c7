"""A small DeepSpeed training job watched by gradloc: TinyGPT, per-rank data, a culprit planted on one rank.

Each rank runs ``M`` micro-batches per optimizer step, each ``engine.backward`` then ``engine.step``
(gradient accumulation: the engine divides each loss by M and steps the optimizer at the boundary),
and calls ``mon.end_step`` at the boundary, between the last ``engine.backward`` and its
``engine.step``, with a probe closure on ``engine.module``. ``plant`` = (rank, step, micro-batch,
sample, position) multiplies one token's loss weight by 3000 on that rank only. Used by
test_deepspeed_watch.py (the tests launch it; deepspeed must be installed).
"""
from __future__ import annotations

from typing import Any

VOCAB, SEQ, B, M = 128, 16, 4, 2


def data(rank: int, steps: int, seed: int = 7):
    import torch

    g = torch.Generator().manual_seed(seed + 1000 * rank)
    tokens = torch.randint(VOCAB, (steps, M, B, SEQ + 1), generator=g)
    return tokens[..., :-1].clone(), tokens[..., 1:].clone(), torch.ones(steps, M, B, SEQ)


def engine_for(stage: int, bf16: bool = False, seed: int = 0) -> Any:
    import deepspeed
    import torch

    from gradloc.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab=VOCAB, seq=SEQ, d_model=32, n_layers=2, n_heads=4, dropout=0.0))
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M, "zero_optimization": zero,
           "bf16": {"enabled": bf16}, "gradient_clipping": 1.0, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=cfg)
    return engine


def train(rank: int, stage: int, steps: int, plant: tuple | None, monitor: bool, bf16: bool = False,
          pad: tuple[int, int] | None = None, build: Any = None, logits: Any = None,
          detector: Any = None) -> dict:
    """``pad`` = (rank, step): that rank's loader emits padding rows (id 0, labels in the loss) at that step.
    ``build(stage, bf16)``: another engine (default: TinyGPT's, ``engine_for``); ``logits(module, x)``: its
    logits (default: the module's output); ``detector``: a DetectorConfig (default: warm-up 5)."""
    import torch

    import gradloc
    from gradloc.demo.model import token_losses
    from tests.distributed.ds_common import engine_params

    engine = (build or engine_for)(stage, bf16)
    out_of = logits or (lambda module, x: module(x))
    x, y, w = data(rank, steps)
    if plant is not None and plant[0] == rank:
        _, s, mb, b, t = plant
        w[s, mb, b, t] = 3000.0
    if pad is not None and pad[0] == rank:
        x[pad[1]], y[pad[1]] = 0, 0
    mon = gradloc.watch(engine, detector=detector or gradloc.DetectorConfig(warmup=5), store=False) if monitor else None
    reports, ds_norms, collectives = [], [], []  # gradloc's collectives (JobComm) per micro-step
    for s in range(steps):
        def loss_for(i: int, mask: torch.Tensor | None = None, s: int = s, module: Any = engine.module) -> torch.Tensor:
            terms = token_losses(out_of(module, x[s, i]), y[s, i]).float() * w[s, i]
            if mask is not None:
                terms = terms * mask
            return terms.sum() / terms.numel()

        total = torch.zeros(())
        for i in range(M):
            if mon is not None:
                before = mon.comm.collectives
                with mon.micro_batch(y[s, i]):
                    loss = loss_for(i, module=engine)
                    engine.backward(loss)
            else:
                loss = loss_for(i, module=engine)
                engine.backward(loss)
            total += loss.detach().float() / M
            if mon is not None and engine.is_gradient_accumulation_boundary():
                reports.append(mon.end_step(total, probe=loss_for))
            if mon is not None:
                collectives.append(mon.comm.collectives - before)
            engine.step()  # every micro-batch: DeepSpeed steps the optimizer at the boundary only
        ds_norms.append(engine.get_global_grad_norm())
    counters = dict(mon.counters) if mon is not None else {}
    if mon is not None:
        mon.close()
    params = engine_params(engine, stage)
    return {"reports": reports, "params": params, "ds_norms": [None if n is None else float(n) for n in ds_norms],
            "collectives": collectives, "counters": counters,
            "kind": mon.job.kind if mon is not None else None}
