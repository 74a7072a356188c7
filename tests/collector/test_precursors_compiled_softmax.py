"""Attention that computes its own softmax, inside compiled graphs (collector/precursors/traced_attention.py's
softmax sites): a hand-written attention (nanoGPT's recipe: q·kᵀ·scale, a causal ``masked_fill``, ``F.softmax``)
and HF's eager attentions that are not the standard recipe (GPT-2's, GPT-OSS's sinks) are measured from their
softmax's input and equal what the eager path measures (the brute-force reference: its mode sees every softmax),
compiled whole or block by block; the numbers are bitwise those of the same compiled model without gradloc; the
method is swapped back exactly on close.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import torch.nn.functional as F
from torch import nn

import gradloc
from gradloc.config import PrecursorConfig
from gradloc.demo.model import GPTConfig, TinyGPT
from tests.collector.test_precursors_compiled import STEPS, _run, _same, hf_eager_compiled_equals_eager

V, T, D, H = 64, 16, 32, 4


class SoftmaxAttention(nn.Module):
    """Causal self-attention written out, as nanoGPT writes it when flash attention is off: ``F.softmax``."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head = H
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The masked logits (B, H, S, S) and the values (B, H, S, C/H)."""
        B, S, C = x.shape
        q, k, v = (t.view(B, S, H, C // H).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))  # (B,S,C)->(B,H,S,C/H)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, H, S, S)
        return att.masked_fill(self.bias[:, :, :S, :S] == 0, float("-inf")), v

    def out(self, att: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, _, S, _ = att.shape
        return self.proj((att @ v).transpose(1, 2).reshape(B, S, D))  # (B, H, S, C/H) -> (B, S, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        att, v = self.scores(x)
        return self.out(F.softmax(att, dim=-1), v)


class TorchSoftmaxAttention(SoftmaxAttention):
    """The same with ``torch.softmax``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        att, v = self.scores(x)
        return self.out(torch.softmax(att, -1), v)


class MethodSoftmaxAttention(SoftmaxAttention):
    """The same with the tensor method (not measured under compile: dynamo traces it as the op)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        att, v = self.scores(x)
        return self.out(att.softmax(dim=-1), v)


STYLES = {"F": SoftmaxAttention, "torch": TorchSoftmaxAttention, "method": MethodSoftmaxAttention}


class Block(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(D), STYLES[style](), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class HandWritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(style) for style in ("F", "torch")])
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


SITES = {"blocks.0.attn", "blocks.1.attn"}


def _checkpointed() -> HandWritten:
    import functools

    from torch.utils.checkpoint import checkpoint

    model = HandWritten()
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


@pytest.mark.parametrize("compiled", [True, "blocks", "checkpointed"])
def test_a_hand_written_softmax_attention_inside_compiled_graphs_equals_the_eager_model_s(compiled) -> None:
    """Compiled whole, block by block (torchtitan's recipe), and whole with ``fullgraph=True`` over checkpointed
    blocks (the mode entered and left inside the checkpointed region)."""
    from gradloc.collector.precursors.structure import attention_sites

    assert set(attention_sites(HandWritten())) == SITES  # by structure: softmax named, a head count
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    make = _checkpointed if compiled == "checkpointed" else HandWritten
    eager, eager_counters, _ = _run(make, False, V)
    got, counters, graphs = _run(make, compiled != "blocks" or "blocks", V, fullgraph=compiled == "checkpointed")
    assert {k[1] for k in eager[1] if k[0] == "attn_entropy"} == SITES and not eager_counters
    for s in range(1, STEPS):
        _same(eager[s], got[s])
    assert {k[1] for k in got[1] if k[0] in ("attn_entropy", "attn_max_logit")} == SITES
    assert counters == ({} if compiled == "blocks" else {"precursors_compiled": 1}), counters
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert graphs[-1] == graphs[1], graphs
    assert torch.softmax is torch._C._VariableFunctions.softmax  # swapped back


@pytest.mark.parametrize("family", ["gpt2", "gptoss"])
def test_hf_eager_attention_that_is_not_the_standard_recipe_is_measured_at_its_softmax_under_compile(family) -> None:
    """GPT-2's eager attention (its own scaling options) and GPT-OSS's (sinks joined to the logits before the
    softmax) are not measured from ``eager_attention_forward``'s arguments; compiled, their softmax is — the same
    softmax the eager path measures."""
    pytest.importorskip("transformers")
    from tests.collector.rules.hf_zoo import build

    got, counters, graphs = hf_eager_compiled_equals_eager(build, family)
    assert len({k[1] for k in got[1] if k[0] == "attn_entropy"}) == 2
    assert {k: n for k, n in counters.items() if k.startswith("precursors_")} == {"precursors_compiled": 1}, counters
    # (GPT-OSS's fused experts' per-token rule says once that it cannot run compiled: uncompilable_said)
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert graphs[-1] == graphs[1], graphs


def _train(watch: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = HandWritten()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = torch.compile(model)
    mon = gradloc.watch(run, opt, store=False, precursors=PrecursorConfig()) if watch else None
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            x, y = torch.randint(V, (2, T), generator=g), torch.randint(V, (2, T), generator=g)
            with (mon.micro_batch(y) if mon else torch.enable_grad()):
                F.cross_entropy(run(x).reshape(-1, V), y.reshape(-1)).backward()
            if mon:
                mon.end_step(None)
            opt.step()
            opt.zero_grad()
    finally:
        if mon:
            mon.close()
    return [p.detach().clone() for p in model.parameters()]


def test_the_numbers_of_a_compiled_hand_written_attention_are_bitwise_the_same_with_and_without_gradloc() -> None:
    """Traced, the wrapper calls ``aten.softmax`` for the method it replaced: the same kernel, the same numbers."""
    torch._dynamo.reset()
    without = _train(False)
    torch._dynamo.reset()
    with_ = _train(True)
    assert all(torch.equal(a, b) for a, b in zip(without, with_))


def test_the_softmax_functions_are_swapped_in_only_for_softmax_sites_and_back_exactly() -> None:
    """``F.softmax`` and ``torch.softmax`` are wrappers while attached (passing through eagerly, also when bound
    then), the originals after; an SDPA site swaps neither; ``Tensor.softmax`` is never touched."""
    from collections import Counter

    from gradloc.collector.precursors.compiled import Folds
    from gradloc.collector.precursors.traced_attention import TracedAttention

    real = {holder: getattr(holder, "softmax") for holder in (F, torch)}
    method = torch.Tensor.softmax
    model = HandWritten()
    traced = TracedAttention(Folds(torch.device("cpu")), 4, Counter())
    assert traced.prepare({n: m for n, m in model.named_modules() if n in SITES}) == []
    assert traced.softmax_sites == SITES
    x = torch.randn(2, H, 3, 3)
    want = torch.softmax(x, -1)
    for _ in range(2):  # attach, detach, attach, detach
        traced.install()
        try:
            bound = {holder: getattr(holder, "softmax") for holder in real}
            assert all(bound[h] is not real[h] for h in real)
            assert torch.equal(x.softmax(-1), want) and torch.equal(F.softmax(x, -1), want)
            assert torch.equal(torch.softmax(x, -1), want)
        finally:
            traced.remove()
        assert all(getattr(h, "softmax") is real[h] for h in real) and torch.Tensor.softmax is method
        assert all(torch.equal(bound[h](x, -1), want) for h in real)  # bound while attached: passes through
    tiny = TinyGPT(GPTConfig(vocab=V, seq=T, d_model=D, n_layers=1, n_heads=H, dropout=0.0))
    sdpa = TracedAttention(Folds(torch.device("cpu")), 4, Counter())
    sdpa.prepare({"blocks.0": tiny.blocks[0]})
    sdpa.install()
    try:
        assert not sdpa.softmax_sites and all(getattr(h, "softmax") is real[h] for h in real)
    finally:
        sdpa.remove()


def test_without_dynamo_s_function_map_the_softmax_is_not_swapped_and_says_so(monkeypatch) -> None:
    """A torch whose dynamo has no function map to build first (a private API that moved): swapping the softmax
    would make dynamo put the wrapper in the graph untraced, so it is left alone, the sites said with why (the hooks
    count those inside a compiled region in ``precursors_unsupported``)."""
    from collections import Counter

    from torch._dynamo import trace_rules

    from gradloc.collector.precursors.compiled import Folds
    from gradloc.collector.precursors.traced_attention import TracedAttention

    def moved():
        raise AttributeError("moved")

    monkeypatch.setattr(trace_rules, "get_torch_obj_rule_map", moved)
    real = F.softmax, torch.softmax
    traced = TracedAttention(Folds(torch.device("cpu")), 4, Counter())
    skipped = traced.prepare({n: m for n, m in HandWritten().named_modules() if n in SITES})
    assert {site for site, _ in skipped} == SITES and all("function map" in why for _, why in skipped)
    traced.install()
    try:
        assert (F.softmax, torch.softmax) == real and not traced.softmax_sites
    finally:
        traced.remove()


def test_a_site_calling_softmax_as_a_tensor_method_is_said_not_measured_under_compile() -> None:
    """Dynamo traces an intermediate tensor's ``.softmax`` as the op itself, past any wrapper: such a site is said
    (with why) rather than left silently empty; the function forms are not mistaken for it."""
    from collections import Counter

    from gradloc.collector.precursors.compiled import Folds
    from gradloc.collector.precursors.structure import softmax_as_method
    from gradloc.collector.precursors.traced_attention import TracedAttention

    class ModuleSoftmax(SoftmaxAttention):  # an nn.Softmax submodule (older BERT-style code): it calls F.softmax
        def __init__(self) -> None:
            super().__init__()
            self.softmax = nn.Softmax(dim=-1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            att, v = self.scores(x)
            return self.out(self.softmax(att), v)

    assert [softmax_as_method(STYLES[style]()) for style in ("F", "torch", "method")] == [False, False, True]
    assert not softmax_as_method(ModuleSoftmax())
    assert not softmax_as_method(TinyGPT(GPTConfig(vocab=V, seq=T, d_model=D, n_layers=1, n_heads=H)).blocks[0])
    traced = TracedAttention(Folds(torch.device("cpu")), 4, Counter())
    skipped = traced.prepare({"a": MethodSoftmaxAttention(), "b": SoftmaxAttention()})
    assert [site for site, _ in skipped] == ["a"] and "tensor method" in skipped[0][1]
    assert traced.softmax_sites == {"b"}
