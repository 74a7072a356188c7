"""Job-wide precursor values under DDP and FSDP2 on gloo (collector/precursors/job.py): from the second step every rank
judges the same values, and they equal one process's over every rank's micro-batches (the brute-force reference,
weights held still by a zero learning rate so both see the same model), with the rank of each extreme; the values
ride the step's one gather (no collective added), and so do the ranks' RL entropy and KL sums."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc.config import PrecursorConfig
from tests.distributed.launch import run

STEPS, AGREEING = 4, 1  # the first step agrees on the layout (the head, found in its first micro-batch, measured in
# its second), the next ones are the job's


def _precursors(reports) -> list[dict]:
    return [{(str(p.kind), p.layer, p.head): (p.value, p.at, p.rank) for p in r.record.precursors} for r in reports]


def _job(rank: int, world: int, kind: str) -> dict:
    import gradloc
    from gradloc.config import PrecursorConfig
    from gradloc.demo.model import token_losses
    from tests.distributed.ddp_job import build, data
    from tests.distributed.loop import run_steps

    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = gradloc.watch(model, opt, store=False, precursors=PrecursorConfig(attention_micro_batches=0, per_head=True))
    reports, collectives = run_steps(model, opt, mon, data(rank, STEPS), STEPS, token_losses=token_losses)
    counters = dict(mon.counters)
    mon.close()
    return {"precursors": _precursors(reports), "collectives": collectives, "counters": counters}


def _reference(world: int) -> list[dict]:
    """One process, every rank's micro-batches of a step in one step (rank r's micro-batch m is number r·M + m)."""
    import gradloc
    from gradloc.config import PrecursorConfig
    from gradloc.demo.model import token_losses
    from tests.distributed.ddp_job import build, data
    from tests.distributed.loop import run_steps

    parts = [data(r, STEPS) for r in range(world)]
    batches = tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(3))  # (steps, W·M, B, T)
    model = build("plain")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = gradloc.watch(model, opt, store=False, precursors=PrecursorConfig(attention_micro_batches=0, per_head=True))
    reports, _ = run_steps(model, opt, mon, batches, STEPS, token_losses=token_losses)
    mon.close()
    return _precursors(reports)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_every_rank_judges_the_job_s_precursor_values_equal_to_one_process_over_all_the_micro_batches(kind):
    from tests.distributed.ddp_job import M

    world = 2
    res = run(_job, world, kind, timeout_s=300)
    ref = _reference(world)
    for r in res:
        assert r["collectives"] == [1] * STEPS  # the values ride the step gather
        assert not r["counters"].get("precursors_own_values")  # agreeing on the layout is not an event
        assert not r["counters"].get("precursors_nonfinite")
    for s in range(AGREEING, STEPS):
        job = res[0]["precursors"][s]
        assert res[1]["precursors"][s] == job  # every rank the same values, extremes and ranks
        assert set(job) == set(ref[s]) and len(job) > 10, sorted(job)
        for key, (value, at, rank) in job.items():
            ref_value, ref_at, ref_rank = ref[s][key]
            assert math.isclose(value, ref_value, rel_tol=1e-9, abs_tol=1e-12), (s, key, value, ref_value)
            assert ref_rank is None
            if ref_at is None:
                assert at is None and rank is None
            else:
                assert (rank * M + at[0], *at[1:]) == ref_at, (key, at, rank, ref_at)
        kinds = {k[0] for k in job}
        assert {"attn_max_logit", "attn_entropy", "logit_max_abs", "logit_lse_sq", "residual_rms"} <= kinds
        assert {rank for _, _, rank in job.values() if rank is not None} == {0, 1}  # extremes on both ranks
    own = res[0]["precursors"][AGREEING - 1]  # a step judged on one rank's own values differs from the job's
    assert any(not math.isclose(own[k][0], ref[AGREEING - 1][k][0], rel_tol=1e-6) for k in own)


def _tp_job(rank: int, world: int, tp: int, sp: bool) -> dict:
    import gradloc
    from gradloc.config import PrecursorConfig
    from tests.distributed.loop import run_steps
    from tests.distributed.tp_job import build, data, token_losses

    model, _ = build(world, tp, sp)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = gradloc.watch(model, opt, store=False, precursors=PrecursorConfig(attention_micro_batches=0, per_head=True))
    reports, collectives = run_steps(model, opt, mon, data(rank // tp, STEPS), STEPS, token_losses=token_losses)
    counters = dict(mon.counters)
    mon.close()
    return {"precursors": _precursors(reports), "counters": counters}


def _vocab_parallel_losses(logits: torch.Tensor, targets: torch.Tensor, group) -> torch.Tensor:
    """Cross entropy (B, T) from this rank's vocabulary shard of the logits (B, T, V/tp), as a vocabulary-parallel
    loss computes it: the shards' maxima, exp-sums and target logits all-reduced over ``group``; the gradient is
    this shard's exactly (softmax − one-hot on its columns: the reduced parts enter as constants)."""
    import torch.distributed as dist

    V, lo = logits.shape[-1], dist.get_rank(group) * logits.shape[-1]
    top = logits.detach().amax(-1)  # (B, T)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    mine = (logits - top[..., None]).exp().sum(-1)  # (B, T, V/tp) -> (B, T)
    total = mine.detach().clone()
    dist.all_reduce(total, group=group)
    inside = (targets >= lo) & (targets < lo + V)
    picked = logits.gather(-1, (targets - lo).clamp(0, V - 1)[..., None]).squeeze(-1) * inside  # (B, T)
    target = picked.detach().clone()
    dist.all_reduce(target, group=group)
    return top + total.log() + (mine - mine.detach()) / total - (target + picked - picked.detach())


def _tp_vocab_job(rank: int, world: int, steps: int, compiled: bool = False) -> dict:
    """tp = 2, the head column-parallel with its logits left split over the vocabulary (as torchtitan's loss
    parallelism and Megatron's output layer leave them), the loss vocabulary-parallel; ``compiled``: the head compiled
    in place (its statistics measured inside its graph, collector/precursors/compiled.py). This toy's TP blocks do not
    compile on torch 2.13 here, with or without gradloc (backward: a DTensor redistribution handed a plain tensor),
    nor does the whole model under one ``torch.compile`` (dynamo fails on the row-parallel embedding's
    ``_MaskPartial`` output)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import gradloc
    from gradloc.config import PrecursorConfig
    from gradloc.demo.parallel import tp_plan
    from tests.distributed.loop import run_steps
    from tests.distributed.tp_job import Toy, data

    model, mesh = Toy(), init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    top, block = tp_plan(False)
    top["head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))  # local (B, T, V/tp) logits
    parallelize_module(model, mesh["tp"], top)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], block)
    group = mesh["tp"].get_group()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    if compiled:
        model.head.compile()
    mon = gradloc.watch(model, opt, store=False, precursors=PrecursorConfig())
    reports, _ = run_steps(model, opt, mon, data(0, steps), steps,
                           token_losses=lambda logits, y: _vocab_parallel_losses(logits, y, group))
    counters = dict(mon.counters)
    mon.close()
    return {"precursors": _precursors(reports), "counters": counters}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_vocabulary_parallel_head_s_logsumexp_squared_is_the_whole_vocabulary_s(compiled: bool) -> None:
    """Each tp rank's head sees half the vocabulary: its own logsumexp² is not the model's. The job's is, over the
    first micro-batch's sampled positions (their shard logsumexps combined on the host) — equal to the whole model's
    logits at those positions in one process (the brute force); the largest |logit| over every micro-batch. The
    same with the head compiled: the step's first call's logsumexps kept inside its graph."""
    from gradloc.collector.precursors import measure
    from tests.distributed.tp_job import Toy, data

    res = run(_tp_vocab_job, 2, STEPS, compiled, timeout_s=600 if compiled else 300)
    x, _, _ = data(0, STEPS)
    model = Toy()
    for s in range(AGREEING + compiled, STEPS):  # compiled: the ranks agree one step later (the head's accumulators
        job = res[0]["precursors"][s]            # join the layout after the first step)
        assert res[1]["precursors"][s] == job
        with torch.no_grad():
            whole = [model(x[s, i]) for i in range(x.shape[1])]  # M × (B, T, V)
        ref = measure.head_stats(whole[0], None, PrecursorConfig().head_positions)
        value, _, _ = job[("logit_lse_sq", "head", None)]
        assert math.isclose(value, float(ref["lse_sq_sum"] / ref["n"]), rel_tol=1e-5), (s, value)
        top = max(float(measure.head_stats(w, None, PrecursorConfig().head_positions)["max_abs"]) for w in whole)
        value, _, _ = job[("logit_max_abs", "head", None)]
        assert math.isclose(value, top, rel_tol=1e-5), (s, value, top)
    for r in res:
        assert not {k for k in r["counters"] if k.startswith("precursors_")}, r["counters"]
        # the per-token scores: a compiled column-parallel head is left unscored and said once, never an error (its
        # DTensor scores once made end_step raise)
        assert r["counters"].get("uncompilable_said", 0) == int(compiled) and not r["counters"].get("hook_errors")


def _tp_reference(dp: int) -> list[dict]:
    """The whole toy in one process over every data rank's micro-batches of a step (data rank d's micro-batch m is
    number d·M + m)."""
    import gradloc
    from gradloc.config import PrecursorConfig
    from tests.distributed.loop import run_steps
    from tests.distributed.tp_job import Toy, data, token_losses

    parts = [data(d, STEPS) for d in range(dp)]
    batches = tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(3))  # (steps, dp·M, B, T)
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = gradloc.watch(model, opt, store=False, precursors=PrecursorConfig(attention_micro_batches=0, per_head=True))
    reports, _ = run_steps(model, opt, mon, batches, STEPS, token_losses=token_losses)
    mon.close()
    return _precursors(reports)


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sp"])
def test_tensor_parallel_heads_are_combined_exactly(sp):
    """tp = 2: each rank holds two of the four heads of every layer; the job's per-head values are the whole model's
    four, in order, and every other statistic the whole model's."""
    from tests.distributed.tp_job import M

    res = run(_tp_job, 2, 2, sp, timeout_s=300)
    ref = _tp_reference(1)
    for s in range(AGREEING, STEPS):
        job = res[0]["precursors"][s]
        assert res[1]["precursors"][s] == job
        assert set(job) == set(ref[s]), sorted(set(job) ^ set(ref[s]))
        for key, (value, at, rank) in job.items():
            ref_value, ref_at, _ = ref[s][key]
            assert math.isclose(value, ref_value, rel_tol=1e-5, abs_tol=1e-9), (s, key, value, ref_value)
            if ref_at is not None:
                assert at[0] == ref_at[0] % M and at[1:] == ref_at[1:], (key, at, ref_at)
        assert {k[2] for k in job if k[0] == "attn_max_logit"} == {None, 0, 1, 2, 3}
    for r in res:
        assert not r["counters"].get("precursors_vocab_split") and not r["counters"].get("precursors_errors")


def _rl_job(rank: int, world: int) -> list:
    """DDP with RL fields: rank r's tokens all have entropy r + 1 and log-probs 0.1 (r + 1) below the rollout's; the
    JobShare each step's drift watch gets is recorded, and each step record's RL entropy and KL, its own and the
    job's."""
    import gradloc
    from gradloc.demo.model import token_losses
    from gradloc.engine import drift
    from tests.distributed.ddp_job import B, M, SEQ, build, data

    model = build("ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = gradloc.watch(model, opt, store=False)
    seen, records = [], []
    original = drift.DriftWatch.watch_step

    def spy(self, record, metas, job=None):
        seen.append(job)
        return original(self, record, metas, job)

    drift.DriftWatch.watch_step = spy
    x, y, _ = data(rank, 2)
    for s in range(2):
        for i in range(M):
            with mon.micro_batch(y[s, i]):
                loss = token_losses(model(x[s, i]), y[s, i]).mean() / M
                mon.rl_fields(logp=torch.full((B, SEQ), -1.0),
                              rollout_logp=torch.full((B, SEQ), -1.0 + 0.1 * (rank + 1)),
                              entropy=torch.full((B, SEQ), float(rank + 1)))
                loss.backward()
        rl = mon.end_step(loss).record.rl
        records.append((rl.entropy_mean, rl.kl_rollout, rl.job_entropy_mean, rl.job_kl_rollout))
        opt.step()
        opt.zero_grad()
    mon.close()
    return [(j.rank, j.rl) for j in seen], records


def test_the_job_s_rl_entropy_and_kl_are_over_every_rank_s_tokens():
    res = run(_rl_job, 2, timeout_s=240)
    r = -0.1 * torch.tensor([1.0, 2.0], dtype=torch.float64)  # each rank's log ratio, trainer − rollout
    kl = float((torch.expm1(r) - r).mean())  # k3 per token, every rank with the same number of tokens
    for rank, (seen, records) in enumerate(res):
        assert len(seen) == 2 and all(got == rank for got, _ in seen)
        for _, (entropy, kl_job) in seen:
            assert entropy == pytest.approx(1.5, rel=1e-9) and kl_job == pytest.approx(kl, rel=1e-5)  # float32 logp
        own = float(torch.expm1(r[rank]) - r[rank])
        for entropy, kl_own, entropy_job, kl_job in records:  # the record (exported, sent): its own and the job's
            assert entropy == pytest.approx(rank + 1.0) and kl_own == pytest.approx(own, rel=1e-5)
            assert entropy_job == pytest.approx(1.5, rel=1e-9) and kl_job == pytest.approx(kl, rel=1e-5)
