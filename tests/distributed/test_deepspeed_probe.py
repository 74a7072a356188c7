"""What a probe (an extra forward+backward of a masked loss) may do under DeepSpeed ZeRO 0-3 (docs/deepspeed-notes.md).

In W = 2 gloo processes, at the boundary (after the last micro-step's ``engine.backward``, before
``engine.step``), a probe runs on the raw module (``engine.module``, not the engine) and takes its
gradient with ``torch.autograd.grad`` w.r.t. the parameters. For every stage it must:

- give exactly the plain-PyTorch gradient of the same masked loss (full-size, also under ZeRO-3),
- fire none of ZeRO's gradient hooks (counted by wrapping the optimizer's hook target),
- leave the training gradient (the DeepSpeedGradAccess pack), the parameters after ``engine.step`` and
  the next step's gradient bitwise equal to a run without the probe (a second engine, same seed and data).

Collectives during the probe: none in stages 0-2, so one rank may probe alone (only rank 0 does here);
ZeRO-3's forward gathers the partitioned parameters, so every rank must probe in lockstep: a probe on
rank 0 alone collides with rank 1's next collective and the job fails.

The contrast: a probe that accumulates into ``.grad`` (``loss.backward()`` with the training ``.grad``
parked, what gradloc does on plain PyTorch) fires ZeRO-2's reduction hooks with no collective at that
moment, and the *next* step's ``engine.backward`` fails ("has already been reduced").
"""
from __future__ import annotations

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

_RESULTS: dict[str, list] = {}


def _launch(name: str, *args) -> list:
    if name not in _RESULTS:
        _RESULTS[name] = run(_rank_main, 2, *args, timeout_s=240, env=ENV)
    return _RESULTS[name]


def _rank_main(rank: int, world: int, runs: list[tuple[int, str, tuple[int, ...]]]) -> dict:
    from tests.distributed import collectives

    collectives.install()
    import deepspeed  # noqa: F401 - after install()

    out = {}
    for stage, kind, probers in runs:
        base = _train(rank, stage, None, probers)
        probed = _train(rank, stage, kind, probers)
        same_params = _equal(base.pop("final"), probed.pop("final"))
        out[f"{stage}-{kind}"] = {**probed, "same_params": same_params, "same_pack": base["pack"] == probed["pack"],
                                  "same_next_pack": base["next_pack"] == probed["next_pack"]}
    return out


def _equal(a: dict, b: dict) -> bool:
    import torch

    return all(torch.equal(a[n], b[n]) for n in a)


def _hooked(optimizer) -> list[int]:
    """Count calls of the method ZeRO's per-parameter gradient hooks call (stage 1/2: process_gradients;
    stage 3: reduce_ready_partitions_and_remove_grads)."""
    calls = [0]
    for name in ("process_gradients", "reduce_ready_partitions_and_remove_grads"):
        if hasattr(optimizer, name):
            original = getattr(optimizer, name)

            def counted(*a, _original=original, **k):
                calls[0] += 1
                return _original(*a, **k)

            setattr(optimizer, name, counted)
            break
    return calls


def _train(rank: int, stage: int, kind: str | None, probers: tuple[int, ...]) -> dict:
    import copy

    import deepspeed
    import torch

    from gradloc.demo.model import GPTConfig, TinyGPT
    from gradloc.parallel.zero import DeepSpeedGradAccess

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=VOCAB, seq=SEQ, d_model=D_MODEL, n_layers=2))
    ref = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 2, "gradient_clipping": 1e-3,
           "zero_optimization": zero_config(stage), "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=cfg)
    access, hook_calls = DeepSpeedGradAccess(engine), _hooked(engine.optimizer)
    rec: dict = {}
    for m in range(2):  # step 0: the probe runs at its boundary
        x, y = data(0, rank, m)
        engine.backward(loss_fn(engine(x), y))
        if m == 1 and kind is not None and rank in probers:
            rec.update(_probe(engine, ref, kind, x, y, hook_calls))
        if m == 1:
            rec["pack"] = access.grad_pack().tolist()
        engine.step()
    rec["final"] = engine_params(engine, stage)
    try:  # step 1: does the probe leave anything behind?
        for m in range(2):
            x, y = data(1, rank, m)
            engine.backward(loss_fn(engine(x), y))
            if m == 1:
                rec["next_pack"] = access.grad_pack().tolist()
            engine.step()
    except Exception as e:  # noqa: BLE001 - reported to the test (every rank fails here, before any collective)
        rec["next_error"], rec["next_pack"] = f"{type(e).__name__}: {e}", None
    engine.destroy()
    return rec


def _probe(engine, ref, kind: str, x, y, hook_calls: list[int]) -> dict:
    """One masked-loss probe on the raw module; its gradient against the plain model's (same, untouched
    initial parameters: no optimizer step has run yet)."""
    import torch

    from gradloc.demo.model import token_losses
    from tests.distributed import collectives

    mask = torch.zeros(B, SEQ)
    mask[0, 3] = 1.0  # one token of this rank's last micro-batch, with the training scaling (÷ tokens ÷ gas)
    params = list(engine.module.parameters())
    c0, h0 = collectives.total(), hook_calls[0]
    loss = (token_losses(engine.module(x), y) * mask).sum() / (B * SEQ) / 2
    forward_collectives = collectives.total() - c0
    if kind == "autograd.grad":
        grads = torch.autograd.grad(loss, params)
    else:  # park the training .grad, accumulate into .grad, read, restore
        parked = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss.backward()
        grads = [p.grad.clone() for p in params]
        for p, g in zip(params, parked):
            p.grad = g
    rec = {"probe_collectives": collectives.total() - c0, "probe_forward_collectives": forward_collectives,
           "probe_hook_calls": hook_calls[0] - h0}
    expected = torch.autograd.grad((token_losses(ref(x), y) * mask).sum() / (B * SEQ) / 2, list(ref.parameters()))
    rec["probe_exact"] = all(g.shape == e.shape and torch.equal(g, e) for g, e in zip(grads, expected))
    return rec


GRAD_RUNS = [(0, "autograd.grad", (0,)), (1, "autograd.grad", (0,)), (2, "autograd.grad", (0,)),
             (3, "autograd.grad", (0, 1))]
BACKWARD_RUNS = [(1, "backward", (0, 1)), (2, "backward", (0, 1)), (3, "backward", (0, 1))]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_autograd_grad_probe_on_the_raw_module_is_exact_and_leaves_training_untouched(ds_shm_op, stage):
    by_rank = _launch("main", GRAD_RUNS + BACKWARD_RUNS)
    probers = dict((s, p) for s, _, p in GRAD_RUNS)[stage]
    for rank, res in enumerate(by_rank):
        r = res[f"{stage}-autograd.grad"]
        assert r["same_pack"] and r["same_params"] and r["same_next_pack"], (rank, r)
        if rank not in probers:
            continue
        assert r["probe_exact"], "the probe gradient is the plain model's, full-size"
        assert r["probe_hook_calls"] == 0, "autograd.grad fires no ZeRO gradient hook"
        if stage < 3:
            assert r["probe_collectives"] == 0, "stages 0-2: a probe is local to its rank"
        else:
            assert r["probe_forward_collectives"] >= 1, "ZeRO-3: forward gathers the partitioned parameters"


def test_probe_that_accumulates_into_grad_fires_zero_hooks_and_breaks_zero2s_next_step(ds_shm_op):
    by_rank = _launch("main", GRAD_RUNS + BACKWARD_RUNS)
    for rank, res in enumerate(by_rank):
        for stage in (1, 2, 3):
            r = res[f"{stage}-backward"]
            assert r["probe_exact"] and r["probe_collectives"] == (1 if stage == 3 else 0), (stage, r)
            assert r["probe_hook_calls"] > 0, (stage, "loss.backward() fires ZeRO's per-parameter hooks")
        assert "has already been reduced" in res["2-backward"]["next_error"], res["2-backward"]


def test_zero3_probe_on_one_rank_alone_fails_the_job(ds_shm_op):
    """Rank 0 probes, rank 1 goes on to its next collective: gloo sees mismatched collectives."""
    with pytest.raises(AssertionError, match="failed|died|did not finish"):
        _launch("zero3-rank0-alone", [(3, "autograd.grad", (0,))])
