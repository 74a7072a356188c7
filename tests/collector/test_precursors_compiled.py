"""Precursor statistics of a compiled model (collector/precursors/compiled.py, traced_attention.py): the attention
sites' (SDPA and HF's eager attention), the loss head's, the final norm's and the MoE routers' values, folded inside
the compiled graph, equal the same model's eager values (the brute-force reference: the eager hooks) from the second
step on; no graph break, no graph traced again after the first step; the monitor says once that the model is handed
over compiled.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

import gradloc
from gradloc.config import PrecursorConfig
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses

STEPS, M = 4, 2


def _run(make, compiled: bool | str, vocab: int, logits=lambda out: out, fullgraph: bool = False,
         **cfg) -> tuple[list[dict], dict, list[int]]:
    """``STEPS`` steps of ``M`` micro-batches at LR 0 (both runs see the same weights); each step's precursor values
    by (kind, layer, head), the monitor's counters and the compiled graphs traced after each step. ``compiled``:
    True hands the model over compiled; ``"blocks"`` compiles its blocks in place (torchtitan's recipe); ``"head"``
    its final norm and head in place."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    if compiled == "blocks":
        for block in model.blocks:
            block.compile()
    if compiled == "head":
        model.ln_f.compile()
        model.head.compile()
    run = torch.compile(model, fullgraph=fullgraph) if compiled is True else model
    mon = gradloc.watch(run, opt, store=False, precursors=PrecursorConfig(head_positions=0, **cfg))
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
    assert compiled and set(compiled) == set(eager), (eager, compiled)
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
                                           ("residual_rms", "ln_f")} | {
        (kind, f"blocks.{i}") for kind in ("attn_max_logit", "attn_entropy") for i in range(2)}
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
    assert {"router_entropy", "expert_load_max", "dead_experts", "logit_max_abs", "attn_max_logit",
            "attn_entropy"} <= kinds, kinds
    assert {k[1] for k in compiled[1] if k[0] == "attn_entropy"} == {"model.layers.0.self_attn",
                                                                      "model.layers.1.self_attn"}
    assert counters["precursors_compiled"] == 1 and not {k for k in counters if k.startswith("precursors_")} - {
        "precursors_compiled"}, counters  # (the token path says its experts' rule cannot run compiled)
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert graphs[-1] == graphs[1], graphs


def hf_eager_compiled_equals_eager(build, family: str) -> tuple[list[dict], dict, list[int]]:
    """An HF ``family`` model with ``attn_implementation="eager"``, compiled, measures what the eager model does from
    step 1 on (compared here); the compiled run's steps, counters and graphs. Dropout off (GPT-2's): eager and
    compiled draw their masks differently."""
    def make():
        model = build(family)
        model.set_attn_implementation("eager")
        return model.eval()

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    logits = (lambda out: out.logits)
    eager, _, _ = _run(make, False, 256, logits)
    compiled, counters, graphs = _run(make, True, 256, logits)
    for s in range(1, STEPS):
        _same(eager[s], compiled[s])
    return compiled, counters, graphs


def test_hf_eager_attention_inside_a_compiled_graph_equals_the_eager_model_s() -> None:
    """``attn_implementation="eager"``: the attention computes its own softmax, in the modeling module's
    ``eager_attention_forward``; compiled, it is measured from that function's arguments (grouped-query heads, the
    additive causal mask, HF's scaling) and equals what the eager path measures from its softmax."""
    pytest.importorskip("transformers")
    from tests.collector.rules.hf_zoo import build

    compiled, counters, graphs = hf_eager_compiled_equals_eager(build, "qwen3")
    assert {k[1] for k in compiled[1] if k[0] in ("attn_entropy", "attn_max_logit")} == {
        "model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert counters == {"precursors_compiled": 1}, counters
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert graphs[-1] == graphs[1], graphs


def test_only_hf_s_standard_eager_attention_is_measured_from_its_arguments_under_compile() -> None:
    """A standard eager attention's modeling module gets the wrapper while attached; a site whose eager attention
    changes its logits after q·kᵀ·scaling + mask (GPT-OSS's sinks) is a softmax site instead (measured at its
    softmax: tests/collector/test_precursors_compiled_softmax.py), its modeling module untouched."""
    pytest.importorskip("transformers")
    import sys
    from collections import Counter

    from gradloc.collector.precursors.compiled import Folds
    from gradloc.collector.precursors.traced_attention import EAGER, TracedAttention, standard_eager
    from tests.collector.rules.hf_zoo import build

    for name, standard in (("qwen3", True), ("gptoss", False)):
        model = build(name)
        model.set_attn_implementation("eager")
        sites = {n: m for n, m in model.named_modules() if n.endswith("self_attn")}
        home = sys.modules[type(next(iter(sites.values()))).__module__]
        assert standard_eager(getattr(home, EAGER)) is standard
        traced, real = TracedAttention(Folds(torch.device("cpu")), 4, Counter()), getattr(home, EAGER)
        assert traced.prepare(sites) == []
        assert traced.softmax_sites == (set() if standard else set(sites))
        traced.install()
        try:
            assert (getattr(home, EAGER) is not real) is standard
            assert standard_eager(getattr(home, EAGER)) is standard  # a second monitor sees the function wrapped
        finally:
            traced.remove()
        assert getattr(home, EAGER) is real


def _tiny():
    return TinyGPT(GPTConfig(vocab=64, seq=16, d_model=32, n_layers=2, n_heads=4, dropout=0.0))


def test_attention_every_other_step_and_in_every_micro_batch_under_compile_equal_the_eager_model_s() -> None:
    """The step and micro-batch gates of attention (``attention_every``, ``attention_micro_batches``) hold inside a
    compiled graph too: it computes the statistics every call, the device gate decides what is folded."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    for cfg in ({"attention_every": 2}, {"attention_micro_batches": 0}):
        eager, _, _ = _run(_tiny, False, 64, **cfg)
        compiled, _, graphs = _run(_tiny, True, 64, **cfg)
        for s in range(1, STEPS):
            _same(eager[s], compiled[s])
        attends = [any(k[0] == "attn_entropy" for k in step) for step in compiled]
        assert attends[1:] == ([False, True, False] if "attention_every" in cfg else [True] * 3), (cfg, attends)
        assert graphs[-1] == graphs[1], graphs
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])


@pytest.mark.parametrize("mode,expect", [
    ("blocks", {("attn_max_logit", "blocks.0"), ("attn_max_logit", "blocks.1")}),
    ("head", {("logit_max_abs", "head"), ("residual_rms", "ln_f")})])
def test_modules_compiled_in_place_are_measured_inside_their_graphs(mode: str, expect: set) -> None:
    """Blocks compiled in place (torchtitan's recipe): their attention measured inside their graphs, the outer
    model's head and norm found by the eager discovery. A head and final norm compiled in place: their hooks run
    only while dynamo traces them, so the discovery does not see them run; they are put where registration order
    places them (structure.complete_order), not replaced by the last module it saw (the blocks' last linear was
    named the head, its output read as logits)."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    eager, _, _ = _run(_tiny, False, 64)
    compiled, counters, graphs = _run(_tiny, mode, 64)
    for s in range(1, STEPS):
        _same(eager[s], compiled[s])
    assert {k[:2] for k in compiled[1] if k[0] in {kind for kind, _ in expect}} == expect
    assert not counters, counters  # whatever ran eagerly was measured there: nothing skipped, nothing said
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert graphs[-1] == graphs[1], graphs


def test_attention_inside_checkpointed_blocks_of_a_fullgraph_compiled_model_equals_the_eager_model_s() -> None:
    """A checkpointed region refuses Python side effects that outlive it (and fullgraph=True any graph break): the
    traced site name is set and undone inside the site, the accumulators are tensors; counted once, not again when
    the backward recomputes the block."""
    import functools

    from torch.utils.checkpoint import checkpoint

    def make():
        model = _tiny()
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        return model

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    eager, _, _ = _run(make, False, 64)
    compiled, counters, graphs = _run(make, True, 64, fullgraph=True)
    for s in range(1, STEPS):
        _same(eager[s], compiled[s])
    assert {k[1] for k in compiled[1] if k[0] == "attn_entropy"} == {"blocks.0", "blocks.1"}
    assert counters == {"precursors_compiled": 1}, counters
    assert graphs[-1] == graphs[1], graphs


def _forward_as(block, heads: int, x: torch.Tensor) -> torch.Tensor:
    """The block's forward with ``heads`` heads whatever its cfg says (a head-sharded attention's stand-in)."""
    from gradloc.demo.model import Block

    block.cfg, saved = GPTConfig(vocab=64, seq=16, d_model=32, n_layers=2, n_heads=heads, dropout=0.0), block.cfg
    try:
        return Block.forward(block, x)
    finally:
        block.cfg = saved


def test_a_compiled_site_whose_calls_have_other_heads_than_its_attributes_say_is_counted_not_measured() -> None:
    import functools

    from gradloc.collector.precursors.structure import site_heads

    def make():
        model = _tiny()
        model.blocks[0].cfg = GPTConfig(vocab=64, seq=16, d_model=32, n_layers=2, n_heads=2, dropout=0.0)
        model.blocks[0].forward = functools.partial(_forward_as, model.blocks[0], 4)  # calls with 4 heads, says 2
        return model

    assert site_heads(_tiny().blocks[0]) == 4 and site_heads(torch.nn.Linear(2, 2)) is None
    torch._dynamo.reset()
    compiled, counters, _ = _run(make, True, 64)
    assert {k[1] for k in compiled[2] if k[0] == "attn_entropy"} == {"blocks.1"}
    assert counters["precursors_unsupported"] == STEPS, counters  # blocks.0: its one measured call a step


def test_attention_sites_by_structure_are_the_modules_whose_forward_calls_attention() -> None:
    from gradloc.collector.precursors.structure import attention_sites

    assert attention_sites(_tiny()) == ["blocks.0", "blocks.1"]

    class Inner(torch.nn.Module):
        def forward(self, q, k, v):
            return [torch.nn.functional.scaled_dot_product_attention(a, b, c) for a, b, c in [(q, k, v)]][0]

    class Outer(torch.nn.Module):  # calls its inner module, not SDPA: not a site (the innermost one is)
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.proj = Inner(), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(self.inner(x, x, x))

    assert attention_sites(Outer()) == ["inner"]  # found inside a comprehension's code too
    pytest.importorskip("transformers")
    from tests.collector.rules.hf_zoo import build

    assert attention_sites(build("qwen3moe")) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def test_the_sdpa_wrapper_is_swapped_back_on_detach_in_again_on_attach_and_a_bound_one_still_works() -> None:
    from collections import Counter

    from gradloc.collector.precursors.compiled import Folds
    from gradloc.collector.precursors.traced_attention import TracedAttention

    real = torch.nn.functional.scaled_dot_product_attention
    traced = TracedAttention(Folds(torch.device("cpu")), 4, Counter())
    q = torch.randn(1, 2, 3, 4)
    try:
        for _ in range(2):  # attach, detach, attach, detach
            traced.install()
            bound = torch.nn.functional.scaled_dot_product_attention
            assert bound is not real
            traced.remove()
            assert torch.nn.functional.scaled_dot_product_attention is real
            torch.testing.assert_close(bound(q, q, q), real(q, q, q))  # bound while attached: passes through
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


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


def test_a_first_call_fold_keeps_the_step_s_first_call_in_a_block_as_it_is() -> None:
    """``fold(first=True)`` (the head's per-position logsumexps under tensor parallelism, module_stats.py): the step's
    first call inside a block, −inf included (a padded position), the later ones and calls outside a block not."""
    from gradloc.collector.precursors.compiled import Folds
    from gradloc.collector.precursors.module_stats import lse_parts_key
    from gradloc.collector.precursors.slots import unpack

    folds, key = Folds(torch.device("cpu")), lse_parts_key("head", 3)
    folds.prepare(key)
    inf = float("-inf")
    folds.fold(key, torch.tensor([9.0, 9.0, 9.0]), first=True)  # no block open: nothing
    folds.begin(0)
    folds.fold(key, torch.tensor([1.0, 2.0, inf]), first=True)
    folds.fold(key, torch.tensor([5.0, 5.0, 5.0]), first=True)  # a second call of the step: not kept
    folds.end()
    folds.begin(1)
    folds.fold(key, torch.tensor([7.0, 7.0, 7.0]), first=True)
    folds.end()
    keys, pack = folds.take()
    v = unpack(keys, pack.numpy())[key]
    assert list(v.value) == [1.0, 2.0, inf] and v.count == 1
    folds.begin(0)  # the next step starts over
    folds.fold(key, torch.tensor([4.0, inf, inf]), first=True)
    folds.end()
    keys, pack = folds.take()
    v = unpack(keys, pack.numpy())[key]
    assert list(v.value) == [4.0, inf, inf] and v.count == 1


def test_the_forward_order_takes_in_modules_compiled_in_place_themselves_not_those_inside_a_compiled_block() -> None:
    from gradloc.collector.precursors.structure import complete_order

    model = _tiny()
    seen = ["tok", "pos", "ln_f"]  # what an eager discovery saw with the blocks and the head compiled in place
    assert complete_order(model, seen) == seen  # nothing compiled: as seen
    for block in model.blocks:
        block.compile()
    assert complete_order(model, seen) == seen  # the blocks' modules: their place is not known, none is the head
    model.head.compile()
    assert complete_order(model, seen) == ["tok", "pos", "ln_f", "head"]
    model.ln_f.compile()
    assert complete_order(model, ["tok", "pos"]) == ["tok", "pos", "ln_f", "head"]
