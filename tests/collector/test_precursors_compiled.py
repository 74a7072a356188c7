"""Precursor statistics of a model handed over compiled (collector/precursors/compiled.py): the loss head's, the final
norm's and the MoE routers' values, folded inside the compiled graph, equal the same model's eager values (the
brute-force reference: the eager hooks) from the second step on; no graph break, no graph traced again per step;
attention is not measured under compile and the monitor says so once."""
from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

import gradloc
from gradloc.config import PrecursorConfig
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses

STEPS, M = 4, 2


def _run(make, compiled: bool, vocab: int, logits=lambda out: out) -> tuple[list[dict], dict, list[int]]:
    """``STEPS`` steps of ``M`` micro-batches at LR 0 (both runs see the same weights); each step's precursor values
    by (kind, layer, head), the monitor's counters and the compiled graphs traced after each step."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    run = torch.compile(model) if compiled else model
    mon = gradloc.watch(run, opt, store=False, precursors=PrecursorConfig(head_positions=0))
    g = torch.Generator().manual_seed(1)
    steps, graphs = [], []
    try:
        for _ in range(STEPS):
            for _ in range(M):
                x, y = torch.randint(vocab, (2, 16), generator=g), torch.randint(vocab, (2, 16), generator=g)
                with mon.micro_batch(y):
                    token_losses(logits(run(x)), y).mean().backward()
            rep = mon.end_step(None)
            steps.append({(str(p.kind), p.layer, p.head): (p.value, p.at) for p in rep.record.precursors})
            graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
            opt.zero_grad()
        return steps, dict(mon.counters), graphs
    finally:
        mon.close()


def _same(eager: dict, compiled: dict) -> None:
    assert compiled and set(compiled) == {k for k in eager if not k[0].startswith("attn_")}, (eager, compiled)
    for key, (value, at) in compiled.items():
        assert math.isclose(value, eager[key][0], rel_tol=1e-5), (key, value, eager[key][0])
        assert at == eager[key][1], key


def test_a_compiled_model_s_head_and_final_norm_equal_the_eager_model_s() -> None:
    torch._dynamo.reset()
    dynamo_utils.counters.clear()

    def make():
        return TinyGPT(GPTConfig(vocab=64, seq=16, d_model=32, n_layers=2, n_heads=4, dropout=0.0))

    eager, eager_counters, _ = _run(make, False, 64)
    compiled, counters, graphs = _run(make, True, 64)
    for s in range(1, STEPS):  # the eager model finds its head in step 0's first micro-batch: compare from step 1
        _same(eager[s], compiled[s])
    assert {k[:2] for k in compiled[1]} == {("logit_max_abs", "head"), ("logit_lse_sq", "head"),
                                           ("residual_rms", "ln_f")}
    assert counters == {"precursors_compiled": 1} and not eager_counters
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert graphs[-1] == graphs[1], graphs  # traced once: nothing that changes per step reaches the graph


def test_a_compiled_moe_s_routers_equal_the_eager_model_s() -> None:
    pytest.importorskip("transformers")
    from tests.collector.rules.hf_zoo import build

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    logits = (lambda out: out.logits)
    eager, _, _ = _run(lambda: build("qwen3moe"), False, 256, logits)
    compiled, counters, graphs = _run(lambda: build("qwen3moe"), True, 256, logits)
    for s in range(1, STEPS):
        _same(eager[s], compiled[s])
    kinds = {k[0] for k in compiled[1]}
    assert {"router_entropy", "expert_load_max", "dead_experts", "logit_max_abs"} <= kinds, kinds
    assert counters["precursors_compiled"] == 1 and not {k for k in counters if k.startswith("precursors_")} - {
        "precursors_compiled"}, counters  # (the token path says its experts' rule cannot run compiled)
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert graphs[-1] == graphs[1], graphs


def test_an_accumulator_nothing_was_folded_into_is_left_out_and_a_call_outside_a_block_folds_nothing() -> None:
    from collections import Counter

    from gradloc.collector.precursors.compiled import Folds
    from gradloc.collector.precursors.slots import Reduce, SlotKey, unpack
    from gradloc.collector.precursors.stats import to_stats

    folds, key = Folds(torch.device("cpu")), SlotKey("logit_max_abs", "head", Reduce.MAX, 1)
    folds.prepare(key)
    folds.fold(key, torch.tensor([3.0]), extreme=torch.tensor(3.0), at=torch.tensor([0, 1]))  # no block open
    keys, pack = folds.take()
    counters = Counter()
    assert to_stats(unpack(keys, pack.numpy()), False, counters) == () and not counters
    folds.begin(1)
    folds.fold(key, torch.tensor([3.0]), extreme=torch.tensor(3.0), at=torch.tensor([0, 1]))
    folds.end()
    keys, pack = folds.take()
    (stat,) = to_stats(unpack(keys, pack.numpy()), False, counters)
    assert (stat.value, stat.at) == (3.0, (1, 0, 1))
    keys, pack = folds.take()  # reset by the take before
    assert to_stats(unpack(keys, pack.numpy()), False, counters) == ()
