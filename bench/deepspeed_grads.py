"""``python -m bench deepspeed-grads [--world 2] [--d-model 256] [--layers 4] [--rounds 20] [--json]``.

At a ZeRO 1/2/3 gradient-accumulation boundary (fp32, W gloo processes on this CPU), time and count the
collectives of two ways to get per-layer gradient statistics of the global gradient:

- ``pack``: :meth:`DeepSpeedGradAccess.grad_pack` (local fragments, one all_gather of the (4L + 2,) packs);
- ``full``: DeepSpeed's ``safe_get_full_grad`` for every parameter (one all_reduce — ZeRO-1/2 — or
  all_gather — ZeRO-3 — of the parameter's full size each), then the same per-layer norms.

Both run ``--rounds`` times on the same boundary (they only read); times are rank 0's medians.
Needs the ``deepspeed`` extra; reuses the test launcher (tests/distributed/launch.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank(rank: int, world: int, stages: list[int], d_model: int, layers: int, rounds: int) -> dict:
    from tests.distributed import collectives

    collectives.install()
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_grad

    from gradloc.collector.layer_stats import foreach_norms
    from gradloc.demo.model import GPTConfig, TinyGPT
    from gradloc.parallel.zero import DeepSpeedGradAccess

    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(vocab=256, seq=64, d_model=d_model, n_layers=layers))
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero,
               "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
        access = DeepSpeedGradAccess(engine)
        x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(rank))
        engine.backward(torch.nn.functional.cross_entropy(engine(x).reshape(-1, 256), x.reshape(-1)))
        named = list(engine.module.named_parameters())

        def full() -> list[float]:
            grads = [safe_get_full_grad(p) for _, p in named]
            return foreach_norms(grads).pow(2).tolist()

        def pack() -> list[float]:
            return access.grad_pack().tolist()

        row = {"params": len(named), "numel": sum(int(getattr(p, "ds_numel", p.numel())) for _, p in named)}
        for name, fn in (("pack", pack), ("full", full)):
            fn()  # warm-up
            times, before = [], collectives.total()
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            row[f"{name}_ms"] = 1e3 * statistics.median(times)
            row[f"{name}_collectives"] = (collectives.total() - before) / rounds
        engine.step()
        engine.destroy()
        out[stage] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench deepspeed-grads", description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    from tests.distributed.ds_common import ENV
    from tests.distributed.launch import run

    res = run(_rank, args.world, [1, 2, 3], args.d_model, args.layers, args.rounds, timeout_s=600, env=ENV)[0]
    if args.json:
        print(json.dumps({"world": args.world, "d_model": args.d_model, "layers": args.layers, "stages": res}))
        return 0
    first = next(iter(res.values()))
    print(f"W={args.world}, TinyGPT d_model={args.d_model} layers={args.layers}: {first['params']} parameters, "
          f"{first['numel'] / 1e6:.2f} M elements; median of {args.rounds}, rank 0")
    print(f"{'stage':>5} {'pack ms':>8} {'colls':>5} {'full ms':>8} {'colls':>5}")
    for stage, r in res.items():
        print(f"{stage:>5} {r['pack_ms']:8.2f} {r['pack_collectives']:5.0f} {r['full_ms']:8.2f} {r['full_collectives']:5.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
