"""DeepSpeed ZeRO 0-3: ``DeepSpeedGradAccess`` reports the global gradient the optimizer sees, with ≤ 1 collective.

Each case (ZeRO stage × fp32 / bf16 / bf16 with fp32 gradient accumulation) trains TinyGPT in W = 1 and 2
gloo processes (real DeepSpeed 0.19.8 engines, CPU accelerator; one launch per W runs every case, one
engine after another) for 2 optimizer steps of 2 micro-steps, with ``gradient_clipping`` 1e-3 — a
reading taken after the clip would be ≤ 1e-3, far below these norms.

Reference: a plain-PyTorch copy of the model (bf16 parameters where DeepSpeed casts them), loaded with
the engine's parameters at the start of each step, computes in every process the gradient of the same
global batch, averaged as DeepSpeed averages it: Σ_ranks Σ_micro ∇(loss / gas) / W, summed in float64.
Per layer, Σ‖g‖², max |g| and Σ‖θ‖² must match it (fp32: 1e-5 relative; measured ≤ 2e-7). In bf16 each
micro-step's gradient is bf16 in both, but DeepSpeed sums the micro-steps and reduces across ranks in bf16
(its ``communication_data_type`` is bf16 under bf16, so even BF16_Optimizer's fp32 accumulation buffer is
rounded to bf16 by the boundary all-reduce, at W = 1 too), each rounding ≤ 2⁻⁸ ≈ 3.9e-3 relative, while
the reference sums in float64: max |g| is one element and shows that whole (measured ≤ 5.2e-3), norms average it (≤ 1.4e-3).
BF16_TOL = 1e-2 covers it. Every case,
bf16 included, must also match — at 1e-5 — (a) the per-parameter full gradients DeepSpeed's own
``safe_get_full_grad`` gathers and (b) the norm DeepSpeed computes inside ``engine.step()`` where it
reports one (``get_global_grad_norm()`` is None with ZeRO-0 fp32 and a client optimizer: the pack still
has the norm). A step pre-hook on the client optimizer, in contrast, sees the clipped gradient (≤ 1e-3).

Collectives are counted by wrapping every ``torch.distributed`` collective in the rank processes before
DeepSpeed is imported (tests/distributed/collectives.py). Off the boundary ``grad_pack`` must return
None and issue none; at the boundary exactly ``collectives_per_boundary`` (1 when W = 2 and the gradient
is partitioned, else 0). The same counter sees ``safe_get_full_grad`` issue one per parameter (the
counter's positive control, and the cost the pack avoids).
"""
from __future__ import annotations

import math
import time

import pytest

from tests.distributed.ds_common import (
    D_MODEL,
    ENV,
    HAS_DEEPSPEED,
    SEQ,
    VOCAB,
    B,
    data,
    engine_params,
    loss_fn,
    zero_config,
)
from tests.distributed.launch import run

pytestmark = pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed extra")

CASES = [(s, "fp32") for s in range(4)] + [(s, "bf16") for s in range(4)] + [(s, "bf16-acc32") for s in (1, 2, 3)]
GAS, STEPS, CLIP = 2, 2, 1e-3
FP32_TOL = 1e-5
BF16_TOL = 1e-2  # measured worst case 5.2e-3 (a layer's max |g|), per-layer norms 1.4e-3, global 1.3e-4 (fp32: 2e-7)
LAUNCH_TIMEOUT_S = 300
NONFINITE_STAGES = (0, 2, 3)


def key(case: tuple[int, str]) -> str:
    return f"z{case[0]}-{case[1]}"


_RESULTS: dict[int, dict] = {}


def results(world: int) -> dict:
    if world not in _RESULTS:
        t0 = time.monotonic()
        by_rank = run(_rank_main, world, CASES, timeout_s=LAUNCH_TIMEOUT_S, env=ENV)
        _RESULTS[world] = {"by_rank": by_rank, "seconds": time.monotonic() - t0}
    return _RESULTS[world]


# -- rank processes ---------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, cases: list) -> dict:
    from tests.distributed import collectives

    collectives.install()  # before deepspeed is imported: its comm backend keeps function references
    import deepspeed  # noqa: F401

    out = {key(c): _run_case(rank, world, *c) for c in cases}
    out["nonfinite"] = {stage: _nonfinite_case(rank, stage) for stage in NONFINITE_STAGES}
    return out


def _nonfinite_case(rank: int, stage: int) -> dict:
    """One boundary; an inf written into the stored gradient of blocks.0.fc.weight where it lives (the
    rank owning its first element); then the pack and the exact per-layer count (a collective). Then
    rank 0's read is made to fail (a stand-in raising function: the failure cannot be provoked for real
    without breaking DeepSpeed) and the pack is taken again."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

    from gradloc.demo.model import GPTConfig, TinyGPT
    from gradloc.parallel.zero import DeepSpeedGradAccess

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=VOCAB, seq=SEQ, d_model=D_MODEL, n_layers=2))
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
           "zero_optimization": zero_config(stage), "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    access = DeepSpeedGradAccess(engine)
    x, y = data(0, rank, 0)
    engine.backward(loss_fn(engine(x), y))
    p = dict(engine.module.named_parameters())["blocks.0.fc.weight"]
    if stage == 0:
        p.grad.view(-1)[0] = float("inf")  # replicated: every rank holds it
    elif stage == 3:
        if rank == 0:
            g = safe_get_local_grad(p)  # a copy: write it back
            g.view(-1)[0] = float("inf")
            safe_set_local_grad(p, g)
    elif p._hp_mapping is not None and p._hp_mapping.lp_fragment_address.start == 0:
        p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group).view(-1)[0] = float("inf")  # a view
    host = access.grad_pack().tolist()
    counts = access.nonfinite_counts()
    layer = access.layers.index("blocks.0.fc")
    if rank == 0:  # a rank whose read fails still joins the all_gather: no hang, and the pack says so

        def broken(p):
            raise RuntimeError("simulated read failure")

        access._local_slice = broken
    failed = access.grad_pack().tolist()
    engine.destroy()
    return {"global_finite": math.isfinite(access.global_norm(host)), "counts": counts,
            "expected": [1 if i == layer else 0 for i in range(access.n_layers)],
            "valid_after_failure": access.valid(failed), "failed_reads": access.failed_reads,
            "collectives_per_boundary": access.collectives_per_boundary}


def _layer_stats(named: dict, grads: dict) -> dict:
    """layer -> [‖g‖, max |g|, ‖θ‖] in float64, grouped like the plain model (module names)."""
    from gradloc.collector.layer_stats import group_name

    out: dict[str, list[float]] = {}
    for n, p in named.items():
        g, t = grads[n].double(), p.double()
        s = out.setdefault(group_name(n, "module"), [0.0, 0.0, 0.0])
        s[0] += float((g * g).sum())
        s[1] = max(s[1], float(g.abs().max()))
        s[2] += float((t * t).sum())
    return {k: [math.sqrt(v[0]), v[1], math.sqrt(v[2])] for k, v in out.items()}


def _reference_grads(ref, step: int, world: int) -> dict:
    import torch

    total = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in ref.named_parameters()}
    for r in range(world):
        for m in range(GAS):
            ref.zero_grad(set_to_none=True)
            x, y = data(step, r, m)
            (loss_fn(ref(x), y) / GAS).backward()
            for n, p in ref.named_parameters():
                total[n] += p.grad.double()
    return {n: g / world for n, g in total.items()}


def _float(x) -> float | None:
    """A norm DeepSpeed reports (a float or a 0-d tensor, depending on the optimizer) as a float."""
    return None if x is None else float(x)


def _run_case(rank: int, world: int, stage: int, dtype: str) -> dict:
    import copy

    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_grad

    from gradloc.collector.layer_stats import group_name
    from gradloc.demo.model import GPTConfig, TinyGPT
    from gradloc.parallel.zero import DeepSpeedGradAccess
    from tests.distributed import collectives

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=VOCAB, seq=SEQ, d_model=D_MODEL, n_layers=2))
    ref = copy.deepcopy(model)
    plain_layers = list(dict.fromkeys(group_name(n, "module") for n, _ in model.named_parameters()))
    bf16 = dtype.startswith("bf16")
    if bf16:
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": GAS,
           "zero_optimization": zero_config(stage), "bf16": {"enabled": bf16}, "gradient_clipping": CLIP,
           "steps_per_print": 10**9}
    if dtype == "bf16-acc32":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=cfg)
    access = DeepSpeedGradAccess(engine)
    seen_by_step_hook: list[float] = []  # Σ‖grad‖² the torch optimizer's step pre-hook sees (this rank's share)
    engine.basic_optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen_by_step_hook.append(
        sum(float(p.grad.double().pow(2).sum()) for g in opt.param_groups for p in g["params"] if p.grad is not None)))
    out: dict = {"layers": access.layers, "plain_layers": plain_layers, "mode": access.mode,
                 "optimizer": type(engine.optimizer).__name__, "collectives_per_boundary": access.collectives_per_boundary,
                 "steps": []}
    for step in range(STEPS):
        start = engine_params(engine, stage)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(start[n])
        rec: dict = {"ref": _layer_stats(start, _reference_grads(ref, step, world)), "off_boundary": []}
        for m in range(GAS):
            x, y = data(step, rank, m)
            engine.backward(loss_fn(engine(x), y))
            before, t0 = collectives.total(), time.perf_counter()
            pack = access.grad_pack()
            elapsed, issued = time.perf_counter() - t0, collectives.total() - before
            if m < GAS - 1:
                rec["off_boundary"].append({"none": pack is None, "collectives": issued})
                engine.step()
                continue
            host = pack.double().tolist()
            L = access.n_layers
            rec.update(released=sum(p.numel() == 0 for p in engine.module.parameters()), present=host[3 * L:4 * L], params_per_layer=[access.group_of.count(i) for i in range(L)],
                       ranks_ok=host[-1], contributors=access.contributors)
            rec.update(pack_s=elapsed, pack_collectives=issued, valid=access.valid(host),
                       global_norm=access.global_norm(host), ds_norm_before=_float(engine.get_global_grad_norm()),
                       ours={s.layer: [s.grad_norm, s.grad_max_abs, s.param_norm] for s in access.unpack(host)})
            before, t0 = collectives.total(), time.perf_counter()
            full = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
            rec.update(full_s=time.perf_counter() - t0, full_collectives=collectives.total() - before,
                       full=_layer_stats(start, full), n_params=len(full))
            engine.step()
        rec["ds_norm_after"] = _float(engine.get_global_grad_norm())
        rec["step_hook_sq"] = seen_by_step_hook[-1]
        out["steps"].append(rec)
    engine.destroy()
    return out


# -- assertions ---------------------------------------------------------------------------------------
def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-12)


def _compare(ours: dict, ref: dict, tol: float) -> list[str]:
    bad = []
    assert set(ours) == set(ref), (sorted(ours), sorted(ref))
    for layer in ref:
        for what, a, b in zip(("norm", "max|g|", "‖θ‖"), ours[layer], ref[layer]):
            if not _close(a, b, tol):
                bad.append(f"{layer} {what}: {a:.8g} vs {b:.8g} (rel {abs(a - b) / max(abs(b), 1e-30):.2e})")
    return bad


def _global(stats: dict) -> float:
    return math.sqrt(sum(v[0] ** 2 for v in stats.values()))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=key)
def test_per_layer_stats_match_the_reference(ds_shm_op, world, case):
    res = results(world)
    tol = FP32_TOL if case[1] == "fp32" else BF16_TOL
    for rank, by_case in enumerate(res["by_rank"]):
        out = by_case[key(case)]
        assert out["layers"] == out["plain_layers"], "layer names differ from the plain model's module names"
        for step, rec in enumerate(out["steps"]):
            where = f"rank {rank} step {step} ({out['optimizer']}, mode {out['mode']})"
            assert rec["valid"] and rec["ranks_ok"] == rec["contributors"], where
            assert rec["present"] == rec["params_per_layer"], (where, "each parameter counts once, on one rank")
            assert _compare(rec["ours"], rec["ref"], tol) == [], where
            assert _close(rec["global_norm"], _global(rec["ref"]), tol), (where, rec["global_norm"], _global(rec["ref"]))
            assert rec["global_norm"] > 100 * CLIP, "the pack must hold the pre-clip gradient"
            # the same gradient DeepSpeed's own (collective, per-parameter) accessor assembles
            assert _compare(rec["ours"], rec["full"], FP32_TOL) == [], where
            if rec["ds_norm_after"] is not None:  # DeepSpeed's own pre-clip norm, computed inside step()
                assert _close(rec["global_norm"], float(rec["ds_norm_after"]), FP32_TOL), (where, rec["ds_norm_after"])
            if case[0] == 3:  # ZeRO-3 really partitioned the parameters: outside forward they are empty
                assert rec["released"] > 0, where
        # a torch step pre-hook on the client optimizer runs after DeepSpeed's clip: it is no place to measure
        for step in range(STEPS):
            shares = [by_case[key(case)]["steps"][step]["step_hook_sq"] for by_case in res["by_rank"]]
            seen = math.sqrt(shares[0] if case[0] == 0 else sum(shares))  # stage 0: replicated; else partitions
            assert seen <= CLIP * (1 + 1e-3), (step, seen)
        # every rank reports the same numbers
        assert out["steps"][-1]["ours"] == res["by_rank"][0][key(case)]["steps"][-1]["ours"]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=key)
def test_collectives(ds_shm_op, world, case):
    res = results(world)
    for rank, by_case in enumerate(res["by_rank"]):
        out = by_case[key(case)]
        partitioned = out["mode"] in ("fragments", "partitions")
        assert out["collectives_per_boundary"] == (1 if partitioned and world > 1 else 0)
        for rec in out["steps"]:
            assert rec["off_boundary"] == [{"none": True, "collectives": 0}] * (GAS - 1)
            assert rec["pack_collectives"] == out["collectives_per_boundary"]
            if partitioned and world > 1:  # positive control: the counter sees DeepSpeed's per-parameter gathers
                assert rec["full_collectives"] == rec["n_params"]


def test_norm_reported_where_deepspeed_reports_none(ds_shm_op):
    """ZeRO-0 fp32 with a client optimizer: DeepSpeed never has a norm; the pack does, before and after."""
    for world in (1, 2):
        for rec in results(world)["by_rank"][0][key((0, "fp32"))]["steps"]:
            assert rec["ds_norm_before"] is None and rec["ds_norm_after"] is None
            assert _close(rec["global_norm"], _global(rec["ref"]), FP32_TOL)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", NONFINITE_STAGES)
def test_nonfinite_gradient_and_failed_read_are_seen_by_every_rank(ds_shm_op, world, stage):
    for by_case in results(world)["by_rank"]:
        r = by_case["nonfinite"][stage]
        assert not r["global_finite"] and r["counts"] == r["expected"], r
    for rank, by_case in enumerate(results(world)["by_rank"]):  # rank 0's read failed on purpose
        r = by_case["nonfinite"][stage]
        assert r["failed_reads"] == (1 if rank == 0 else 0)
        # combined packs are invalid on every rank; an uncombined one only where the read failed
        assert r["valid_after_failure"] == (rank != 0 and not r["collectives_per_boundary"]), (rank, r)


def report() -> None:
    """Worst relative deviations and costs per case (the numbers in docs/deepspeed-notes.md):
    ``python -m tests.distributed.test_deepspeed_grads``."""
    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-30)

    for world in (1, 2):
        res = results(world)
        print(f"W={world}: launch {res['seconds']:.1f} s (all cases, one process group)")
        print("  case           optimizer                      mode        vs reference: norm  max|g|  ‖θ‖  global"
              "  vs full  vs DS norm | pack ms colls | full ms colls")
        for case in CASES:
            w = dict.fromkeys(("norm", "max", "theta", "global", "full", "ds"), 0.0)
            pack_ms, full_ms, pack_c, full_c = [], [], 0, 0
            for by_case in res["by_rank"]:
                out = by_case[key(case)]
                for rec in out["steps"]:
                    for layer, ours in rec["ours"].items():
                        for i, name in enumerate(("norm", "max", "theta")):
                            w[name] = max(w[name], rel(ours[i], rec["ref"][layer][i]))
                        w["full"] = max([w["full"]] + [rel(a, b) for a, b in zip(ours, rec["full"][layer])])
                    w["global"] = max(w["global"], rel(rec["global_norm"], _global(rec["ref"])))
                    if rec["ds_norm_after"] is not None:
                        w["ds"] = max(w["ds"], rel(rec["global_norm"], rec["ds_norm_after"]))
                    pack_ms.append(1e3 * rec["pack_s"])
                    full_ms.append(1e3 * rec["full_s"])
                    pack_c, full_c = max(pack_c, rec["pack_collectives"]), max(full_c, rec["full_collectives"])
            print(f"  {key(case):14s} {out['optimizer']:30s} {out['mode']:10s} "
                  + " ".join(f"{w[k]:.1e}" for k in ("norm", "max", "theta", "global", "full", "ds"))
                  + f" | {min(pack_ms):6.2f} {pack_c:4d} | {min(full_ms):6.2f} {full_c:4d}")


if __name__ == "__main__":
    report()
