"""Per-sample surprise under tensor and pipeline parallelism (collector/surprise.py, parallel/tokens.py). TP: the loss head is
column-parallel, so each tp rank holds its vocabulary shard's columns of the head's output gradient; each reads
u_p = −g_p[label_p] where the label is one of its columns, and the token group's one exchange per step adds the
shards' parts up. One rank per data index (its first tp rank) judges the samples. The judged samples' surprise
equals the same model's in one process, step by step while training (tp alone) and on the first step (FSDP2 × TP);
the other tp rank judges none. PP: the last stage holds the head and judges, from the first step on (the stage's
first-step shape inference belongs to no micro-batch); the first stage judges none."""
from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from tests.distributed.launch import run
from tests.distributed.loop import run_steps

STEPS = 3


def _samples(rank: int, world: int, tp: int) -> dict[str, Any]:
    import gradloc
    from tests.distributed import tp_job
    from tests.distributed.loop import prepare, run_steps

    model, _ = tp_job.build(world, tp, sp=True)
    dp_rank = rank // tp
    x, y, w = tp_job.data(dp_rank, STEPS)
    cfg = gradloc.SampleConfig(warmup_samples=8)
    opt, mon, _ = prepare(model, (x, y, w), None, dp_rank, True, False, {"samples": cfg})
    reports, _ = run_steps(model, opt, mon, (x, y, w), STEPS, token_losses=tp_job.token_losses)
    out = {"tp_rank": rank % tp, "dp_rank": dp_rank,
           "judged": [r.record.samples.judged if r.record.samples else None for r in reports],
           "surprise": [float(v) for v in mon.samples.judge.mean.values[: mon.samples.judge.mean.n]],
           "counters": dict(mon.counters)}
    mon.close()
    return out


def _reference(dp_rank: int, steps: int) -> list[float]:
    """The judged samples' mean surprise (in judging order) of data rank ``dp_rank``'s micro-batches, the toy in one
    process trained on them alone (its loss as a tp job's: Σ w·ce / (B·T·M))."""
    import gradloc
    from tests.distributed import tp_job
    from tests.distributed.loop import prepare, run_steps

    model = tp_job.Toy()
    x, y, w = tp_job.data(dp_rank, steps)
    opt, mon, _ = prepare(model, (x, y, w), None, dp_rank, True, False,
                          {"samples": gradloc.SampleConfig(warmup_samples=8)})
    run_steps(model, opt, mon, (x, y, w), steps, token_losses=tp_job.token_losses)
    got = [float(v) for v in mon.samples.judge.mean.values[: mon.samples.judge.mean.n]]
    mon.close()
    return got


@pytest.mark.parametrize("world", [2, 4], ids=["tp", "fsdp-tp"])
def test_per_sample_surprise_under_tensor_parallelism(world):
    from tests.distributed.tp_job import B, M

    tp = 2
    results = run(_samples, world, tp, timeout_s=600)
    per_step = B * M  # samples of a data rank per step
    for r in results:
        assert r["counters"].get("sample_errors", 0) == 0 and r["counters"].get("token_errors", 0) == 0
        if r["tp_rank"] != 0:
            assert r["judged"] == [None] * STEPS and r["surprise"] == []  # one rank of the tp group judges
            continue
        assert r["judged"] == [per_step] * STEPS
        steps = STEPS if world == tp else 1  # FSDP2 × TP: the data ranks' mean trains it; step 0 is each one's own
        ref = _reference(r["dp_rank"], steps)
        assert r["surprise"][: len(ref)] == pytest.approx(ref, rel=1e-4)


def _megatron_samples(gradloc: Any) -> Any:
    from tests.distributed.megatron_job import SEQ

    return gradloc.SampleConfig(warmup_samples=8, min_tokens=SEQ)  # the toy's samples have SEQ (12) loss tokens


def _megatron(rank: int, world: int, vocab_parallel: bool, sp: bool = False) -> dict[str, Any]:
    import gradloc
    from tests.distributed.megatron_job import surprise

    return surprise(rank, world, 2, STEPS, vocab_parallel, _megatron_samples(gradloc), sp=sp)


def _megatron_reference(vocab_parallel: bool) -> list[float]:
    """The judged samples' mean surprise of PlainToy (the Megatron toy unpartitioned, in one process) on the same
    data, in judging order."""
    import gradloc
    from tests.distributed.megatron_job import data, token_losses
    from tests.distributed.test_megatron import PlainToy

    model = PlainToy(vocab_parallel=vocab_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, store=False, samples=_megatron_samples(gradloc))
    run_steps(model, opt, mon, data(STEPS), STEPS, token_losses=token_losses)
    got = [float(v) for v in mon.samples.judge.mean.values[: mon.samples.judge.mean.n]]
    mon.close()
    return got


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core (scripts/setup.sh)")
@pytest.mark.parametrize("vocab_parallel,sp", [(False, False), (True, False), (True, True)],
                         ids=["replicated-head", "vocab-parallel-head", "sequence-parallel"])
def test_per_sample_surprise_under_megatron_tensor_parallelism(vocab_parallel, sp):
    """Megatron-core TP on 2 gloo ranks: a torch head replicated over tp (each rank reads the whole gradient, 1/tp
    each), or Megatron's own column-parallel output layer with vocab-parallel cross entropy (each rank reads its
    vocabulary shard of the sequence-first ``[s, b, V/tp]`` gradient; with ``sequence_parallel=True`` too, the head
    gathering the sequence itself). The first tp rank judges every sample, and
    their surprise equals the unpartitioned model's in one process over the training steps; the other judges none."""
    from tests.distributed.megatron_job import B, M
    from tests.distributed.test_megatron import ENV

    results = run(_megatron, 2, vocab_parallel, sp, timeout_s=300, env=ENV)
    ref = _megatron_reference(vocab_parallel)
    assert len(ref) == B * M * STEPS  # every sample judged in one process
    for r in results:
        assert not {k for k in r["counters"] if k.endswith("errors")}, r["counters"]
        if r["tp_rank"] != 0:
            assert r["judged"] == [None] * STEPS and r["surprise"] == []
            continue
        assert r["judged"] == [B * M] * STEPS
        assert r["surprise"] == pytest.approx(ref, rel=1e-4)


def _pp(rank: int, world: int) -> dict[str, Any]:
    import gradloc
    from tests.distributed.pp_job import train

    return train(rank, world, "toy", "GPipe", STEPS, samples=gradloc.SampleConfig(warmup_samples=8))


def test_per_sample_surprise_under_pipeline_parallelism():
    import gradloc
    from tests.distributed.pp_job import B, reference_surprise

    results = run(_pp, 2, timeout_s=600)
    ref = reference_surprise(STEPS, samples=gradloc.SampleConfig(warmup_samples=8))
    assert len(ref) == B * STEPS  # one sample per micro-batch, every one judged
    first, last = sorted(results, key=lambda r: r["stage"])
    assert first["surprise"] == [] and first["counters"].get("sample_errors", 0) == 0
    assert last["surprise"] == pytest.approx(ref, rel=1e-4)
