"""Megatron-core tensor parallelism (``ColumnParallelLinear`` / ``RowParallelLinear``, activations ``[s, b, h]``)
on 2 gloo processes, ``initialize_model_parallel(tensor_model_parallel_size=2)``, against the same model
unpartitioned in plain torch in this process (``PlainToy``: ``nn.Linear``s, batch-first): the partitions gathered
are bitwise its weights; per-layer norms equal its ``.grad`` norms within 1e-5 relative (partitions added,
replicas counted once); per-token scores, the Megatron rule's summed over the tp group, equal the ``nn.Linear``
rule's on it; nothing is unattributed; a culprit planted on one token is localized with ≤ 3 probes; the
parameters come out bitwise the same with and without gradloc (tests/distributed/megatron_job.py)."""
from __future__ import annotations

import importlib.util
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed.launch import run
from tests.distributed.loop import essentials
from tests.distributed.megatron_job import (
    BLOCKS,
    FF,
    HD,
    HEADS,
    SEQ,
    VOCAB,
    B,
    D,
    M,
    data,
    head_precursors,
    init_method,
    module_norms,
    token_losses,
)

STEPS, PLANT_STEP = 7, 6
ENV = {"NO_VCS_VERSION": "1"}  # megatron's package_info would otherwise run `git rev-parse` at import

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="needs megatron-core (scripts/setup.sh)")


def _bitwise(rank: int, world: int, plant: tuple, sp: bool = False) -> dict:
    from tests.distributed.megatron_job import bitwise

    return bitwise(rank, world, 2, STEPS, plant, sp=sp)


# -- the reference: the same model unpartitioned, plain torch, batch-first, in this process ----------------
class PlainAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = _linear(D, 3 * D), _linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        Bx, T, _ = x.shape
        q, k, v = self.qkv(x).view(Bx, T, HEADS, 3, HD).unbind(3)  # (B, T, 3·D) -> 3 × (B, T, H, hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, T, H, hd) -> (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(Bx, T, D))  # (B, H, T, hd) -> (B, T, D)


class PlainMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = _linear(D, FF), _linear(FF, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class PlainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.mlp = PlainAttention(), PlainMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PlainToy(nn.Module):
    """The unpartitioned model, batch-first, in plain torch: the same parameter names and draws as MegatronToy
    (``vocab_parallel``: its head drawn as Megatron's column-parallel output layer is)."""

    def __init__(self, seed: int = 0, vocab_parallel: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(PlainBlock() for _ in BLOCKS)
        self.norm = nn.LayerNorm(D)
        self.head = _linear(D, VOCAB, bias=False) if vocab_parallel else nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))  # (B, T, V)


def _linear(d_in: int, d_out: int, bias: bool = True) -> nn.Linear:
    """nn.Linear initialised as Megatron's CPU initialisation does: the whole (out, in) weight drawn by
    ``init_method``, the bias zero (``skip_init``: nothing else drawn)."""
    lin = torch.nn.utils.skip_init(nn.Linear, d_in, d_out, bias=bias)
    with torch.no_grad():
        init_method()(lin.weight)
        if bias:
            lin.bias.zero_()
    return lin


def reference(steps: int, vocab_parallel: bool = False) -> dict[str, Any]:
    """PlainToy in this process (no megatron): its initial weights, the first step's per-module gradient norms
    (from ``.grad``) and gradloc's report of that step (per-layer norms, top tokens)."""
    import gradloc

    model = PlainToy(vocab_parallel=vocab_parallel)
    out: dict[str, Any] = {"init": {n: p.detach().numpy().copy() for n, p in model.named_parameters()}}
    x, y, w = data(steps)
    mon = gradloc.watch(model, store=False)
    total = torch.zeros(())
    for i in range(M):
        with mon.micro_batch(y[0, i]):
            loss = (token_losses(model(x[0, i]), y[0, i]) * w[0, i]).sum().div(B * SEQ * M)
            loss.backward()
        total += loss.detach()
    out["norms"] = module_norms({n: p.grad.numpy() for n, p in model.named_parameters()})
    out["report"] = essentials(mon.end_step(total))
    mon.close()
    return out


def reference_localization(plant: tuple, vocab_parallel: bool) -> dict[str, Any]:
    """PlainToy trained as the ranks train MegatronToy (AdamW, the planted weight): the planted step's localization
    and every step's loss-head precursor values."""
    import gradloc
    from tests.distributed.loop import run_steps

    model = PlainToy(vocab_parallel=vocab_parallel)
    x, y, w = data(STEPS)
    s, mb, b, t = plant
    w[s, mb, b, t] = 3000.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, store=False, detector=gradloc.DetectorConfig(warmup=5))
    reports, _ = run_steps(model, opt, mon, (x, y, w), STEPS, token_losses=token_losses)
    mon.close()
    return essentials(reports[s])["loc"], [head_precursors(r) for r in reports]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_megatron_tensor_parallel(sp: bool):
    """``sp``: sequence_parallel=True (parallel/megatron_sp.py): the SP region's norms on each rank's positions,
    the linears' factors multiplied at the step's token-group all-reduce, Megatron's own reduction of the
    ``sequence_parallel`` gradients before ``end_step``; the head is then Megatron's column-parallel output layer."""
    plant = (PLANT_STEP, 1, 2, 5)  # (step, micro-batch, sample, position)
    imported = "megatron" in sys.modules
    results = run(_bitwise, 2, plant, sp, timeout_s=300, env=ENV)
    assert imported or "megatron" not in sys.modules  # no result imports it here (megatron_job.whole_params)
    ref = reference(STEPS, vocab_parallel=sp)
    want = ref["report"]
    assert set(want["layers"]) == set(ref["norms"])  # every module with parameters is a layer
    for layer, norm in ref["norms"].items():  # gradloc's reduction of the reference equals its .grad
        assert want["layers"][layer] == pytest.approx(norm, rel=1e-6), layer
    assert any(".qkv" in n for n in want["layers"]) and want["unattributed"] == pytest.approx(0.0, abs=1e-12)
    for r in results:
        assert r["bitwise"], "parameters differ with gradloc attached"
        for n, p in ref["init"].items():  # the partitions, gathered, are the reference's weights
            assert np.array_equal(r["init"][n], p), n
        rep0 = r["reports"][0]
        assert set(rep0["layers"]) == set(ref["norms"])
        for layer, norm in ref["norms"].items():
            assert rep0["layers"][layer] == pytest.approx(norm, rel=1e-5), layer  # gradloc's, under TP
            assert r["norms"][layer] == pytest.approx(norm, rel=1e-5), layer  # the gathered .grad: same step
        assert rep0["dropped"] == 0 and rep0["unattributed"] == pytest.approx(0.0, abs=1e-9)
        assert [t[:3] for t in rep0["top"]] == [t[:3] for t in want["top"]]
        for (*_, got), (*_, exp) in zip(rep0["top"], want["top"]):
            assert got == pytest.approx(exp, rel=1e-4)  # the tp group's summed scores are the whole model's
        assert rep0["total_score"] == pytest.approx(want["total_score"], rel=1e-4)
        # a healthy step: the step gather + the token group's scores (docs/ARCHITECTURE.md 3), with SP as without
        assert r["collectives"][:PLANT_STEP] == [2] * PLANT_STEP, r["collectives"]
        loc = r["reports"][PLANT_STEP]["loc"]
        assert loc is not None and loc["status"] == "located" and loc["probes"] <= 3, loc
        assert loc["culprits"][0] == (0, 1, 2, 5)
    assert results[0]["reports"][PLANT_STEP]["loc"] == results[1]["reports"][PLANT_STEP]["loc"]
    (want_loc, want_head), loc = reference_localization(plant, sp), results[0]["reports"][PLANT_STEP]["loc"]
    for s in range(1, PLANT_STEP):  # the head's precursors (step 0: the ranks agree on their layout)
        for r in results:  # Megatron's [s, b, V(/tp)] logits read as (b, s): the same rows and positions
            assert r["head"][s]["logit_max_abs"][1] == want_head[s]["logit_max_abs"][1], s
            assert r["head"][s]["logit_max_abs"][0] == pytest.approx(want_head[s]["logit_max_abs"][0], rel=1e-4)
            if not sp:  # the head whole: over every micro-batch, as the reference; under sp (the head split over
                # the vocabulary) over the first micro-batch's positions, its shards combined (the exact check of
                # that: tests/distributed/test_precursors_job.py)
                assert r["head"][s]["logit_lse_sq"][0] == pytest.approx(want_head[s]["logit_lse_sq"][0], rel=1e-4)
            assert "logit_lse_sq" in r["head"][s] and not r["counters"], r["counters"]
            # the final norm's input: whole on every rank, or (sp) each rank's block of the sequence, placed there
            assert r["head"][s]["residual_rms"][1] == want_head[s]["residual_rms"][1], s
            assert r["head"][s]["residual_rms"][0] == pytest.approx(want_head[s]["residual_rms"][0], rel=1e-5)
    assert loc["probes"] == want_loc["probes"] and loc["culprits"][0][1:] == want_loc["culprits"][0][1:]
    assert loc["explained"] == pytest.approx(want_loc["explained"], rel=1e-3)  # the probes' sums are the whole model's
