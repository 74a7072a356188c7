"""torchtitan jobs for the distributed tests: its own Llama 3 / Qwen3-MoE / DeepSeek-V3, parallelized by its own
functions (tests/titan.py), trained a few AdamW steps with gradloc watching, next to references.

``kind``: "tp" (TP alone), "fsdp-tp" (FSDP2 × TP on (dp 2, tp 2)), "ep" (Qwen3-MoE, EP over the data
shard dim), "ep-dsv3" (DeepSeek-V3: MLA, a dense first layer, shared + routed experts; EP the same way). Each data rank trains on its own micro-batches (the tp ranks of a data index on the same ones);
the loss of micro-batch i is Σ w·mask·ce / (B·T·M·dp), torchtitan's way (its FSDP sums: the loss is divided
by the job's token count). ``plant`` = (data rank, step, micro-batch, sample, position): that token's loss
weight × 3000.

The reference the test holds gradloc's numbers against: torchtitan's own placement-aware norm
(``clip_grad_norm_`` with max_norm=inf) for the global norm, and each layer's norm from its parameters'
``full_tensor()`` gradients (a collective per parameter: test code only).
"""
from __future__ import annotations

from typing import Any

import torch

from tests import titan
from tests.distributed.loop import essentials, prepare, run_steps, token_losses, whole

SEQ, B, M = 16, 4, 2
KINDS = {"tp": dict(tp=2), "fsdp-tp": dict(dp_shard=2, tp=2), "ep": dict(dp_shard=2, ep=2),
         "ep-dsv3": dict(dp_shard=2, ep=2)}
MODELS = {"ep": "qwen3", "ep-dsv3": "deepseek_v3"}  # the rest: llama3
BUILDERS = {"llama3": titan.llama3, "qwen3": titan.qwen3_moe, "deepseek_v3": titan.deepseek_v3}


def model_for(kind: str, seed: int = 0, parallelism: Any = None) -> tuple[torch.nn.Module, str]:
    name = MODELS.get(kind, "llama3")
    return BUILDERS[name](seed, parallelism=parallelism), name


def build(world: int, kind: str, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    spec = KINDS[kind]
    dims = titan.parallel_dims(world, **spec)
    model, name = model_for(kind, seed, titan.parallelism_config(**spec))
    return titan.parallelize(model, dims, name), dims


def data(dp_rank: int, steps: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000 * dp_rank)
    tokens = torch.randint(titan.VOCAB, (steps, M, B, SEQ + 1), generator=g)
    return tokens[..., :-1].clone(), tokens[..., 1:].clone(), torch.ones(steps, M, B, SEQ)


def train(rank: int, world: int, kind: str, steps: int, plant: tuple | None = None, monitor: bool = True, invariants: bool = False,
          **watch: Any) -> dict[str, Any]:

    model, dims = build(world, kind)
    dp = dims.dp_shard * dims.dp_replicate
    dp_rank = rank // (world // dp)  # tp (and ep within dp) innermost
    x, y, w = data(dp_rank, steps)
    opt, mon, inv = prepare(model, (x, y, w), plant, dp_rank, monitor, invariants, watch)
    out: dict[str, Any] = {}

    def norms() -> None:
        out["titan_norm"] = float(titan.grad_norm(model, dims))
        sq: dict[str, float] = {}
        for n, p in model.named_parameters():
            mod = n.rsplit(".", 1)[0]
            sq[mod] = sq.get(mod, 0.0) + float(whole(p.grad).double().pow(2).sum())
        out["ref_layers"] = {k: v ** 0.5 for k, v in sq.items()}

    reports, _ = run_steps(model, opt, mon, (x, y, w), steps, token_losses=token_losses, dp=dp,
                           end_step=inv.end_step if inv is not None else None, after_first_backward=norms)
    out["reports"] = [essentials(r) for r in reports]
    out["params"] = {n: whole(p).detach().clone() for n, p in model.named_parameters()}
    if inv is not None:
        out["steps"], out["trace"] = inv.steps, list(mon.comm.state.trace)
    if mon is not None:
        out["counters"] = dict(mon.counters)
        mon.close()
    return out


def train_both(rank: int, world: int, kind: str, steps: int, plant: tuple | None = None) -> dict[str, Any]:
    """Without gradloc, then with it: the watched run's results and whether the parameters are bitwise equal."""
    plain = train(rank, world, kind, steps, plant, monitor=False)
    watched = train(rank, world, kind, steps, plant)
    watched["bitwise"] = all(torch.equal(plain["params"][n], watched["params"][n]) for n in plain["params"])
    del watched["params"]
    return watched


def reference_top(kind: str, steps: int) -> list[tuple]:
    """gradloc's top tokens of data rank 0's first step on the same torchtitan model in one process, unparallelized
    (same seed, same loss scaling): what the TP ranks' summed scores must equal."""
    import gradloc

    dp = KINDS[kind].get("dp_shard", 1)
    model, _ = model_for(kind)
    x, y, w = data(0, steps)
    mon = gradloc.watch(model, store=False)
    for i in range(M):
        with mon.micro_batch(y[0, i]):
            (token_losses(model(x[0, i]), y[0, i]) * w[0, i]).sum().div(B * SEQ * M * dp).backward()
    rec = mon.end_step(None).record
    top = [(t.micro_batch, t.sample, t.position, t.score, [(ls.layer, ls.share * t.score) for ls in t.layers])
           for t in rec.tokens.top]
    mon.close()
    return top
