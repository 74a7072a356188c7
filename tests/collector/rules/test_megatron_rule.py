"""Megatron-core's ColumnParallelLinear / RowParallelLinear per-token rule vs a brute-force autograd reference.

One process, tensor-parallel size 1: Megatron's mappings need a tp group even at size 1 (without
``torch.distributed`` they get ``None`` and fail on it), so the module opens a 1-rank gloo group (an in-memory
store: no port) and ``initialize_model_parallel(1)``, and closes both afterwards (``_one_rank``). megatron is
imported there too, not at collection: ``import megatron.core`` replaces ``torch.storage._load_from_bytes``
process-wide (every tensor pickled afterwards names ``megatron.core.safe_globals``, so whoever unpickles it
imports megatron) and adds to torch's ``weights_only`` allowlist; the fixture puts both back when the module
is done. A stand-in
group saying "rank r of 2" (``_Group``), set on a layer holding one rank's shard, checks the rule's tp>1 slicing
(a gathered output's gradient, a scattered input) without running a collective.

Reference: every position p = (s, b) gets its own private copy of the layer's trainable parameters, the layer
runs on a_p alone, ⟨output + (returned bias, when ``skip_bias_add``: what the caller adds), g_p⟩ is
backpropagated, and the score of p is Σ ‖∂/∂θ_p‖². Nothing of the rule's closed form is used.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

from gradloc.collector.rules import rule_for
from gradloc.collector.rules.megatron import MegatronLinearRule
from tests.collector.rules.reference import SETTINGS

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")  # megatron's own calls
mc: dict = {}  # megatron's modules, imported by ``_one_rank``


@pytest.fixture(autouse=True, scope="module")
def _one_rank():
    """megatron imported, and a 1-rank gloo job with Megatron's tp size 1, for this module only."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already open in this process")
    load_from_bytes, safe = torch.storage._load_from_bytes, torch.serialization.get_safe_globals()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
            layers = pytest.importorskip("megatron.core.tensor_parallel.layers",
                                         reason="needs megatron-core (scripts/setup.sh)")
            from megatron.core import parallel_state as ps
            from megatron.core.model_parallel_config import ModelParallelConfig
        mc.update(layers=layers, ps=ps, Config=ModelParallelConfig)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=1)
            yield
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    finally:  # what importing megatron.core changed process-wide
        torch.storage._load_from_bytes = load_from_bytes
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(safe)


class _Group:
    """Stand-in for a tp process group on a shard that never runs forward: the rule asks it ``rank()``."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self._rank, self._size = rank, size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _layer(kind: str, d_in: int, d_out: int, bias: bool, skip: bool, flag: bool,
           dtype: torch.dtype = torch.float64) -> nn.Module:
    """``flag``: gather_output (column) / input_is_parallel (row)."""
    layers = mc["layers"]
    cfg = mc["Config"](use_cpu_initialization=True, params_dtype=dtype)
    init = lambda w: nn.init.normal_(w, std=0.7)  # noqa: E731
    tp = mc["ps"].get_tensor_model_parallel_group()
    if kind == "column":
        layer = layers.ColumnParallelLinear(d_in, d_out, config=cfg, init_method=init, bias=bias,
                                            skip_bias_add=skip, gather_output=flag, tp_group=tp)
    else:
        layer = layers.RowParallelLinear(d_in, d_out, config=cfg, init_method=init, bias=bias,
                                         input_is_parallel=flag, skip_bias_add=skip, tp_group=tp)
    if bias:
        with torch.no_grad():
            layer.bias.normal_()  # Megatron zeroes biases; the gradient does not care, the output does
    return layer


def _apply(layer: nn.Module, params: dict, x: torch.Tensor) -> torch.Tensor:
    """What the caller sees: the output, plus the returned bias when it is left to the caller to add."""
    y, b = functional_call(layer, params, (x,))
    return y if b is None else y + b


def reference(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """[s, b] float64: Σ over trainable params of ‖∇θ_p ⟨y_p, g_p⟩‖², θ_p private to position p."""
    s, b = x.shape[:2]
    trainable = {k: p for k, p in layer.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in layer.named_parameters() if not p.requires_grad}
    out = torch.zeros(s, b, dtype=torch.float64)
    for i in range(s):
        for j in range(b):
            if not trainable:
                continue
            copies = {k: p.detach().clone().requires_grad_(True) for k, p in trainable.items()}
            y = _apply(layer, {**frozen, **copies}, x[i:i + 1, j:j + 1])  # [1, 1, h_out]
            grads = torch.autograd.grad((y * g[i:i + 1, j:j + 1]).sum(), list(copies.values()), allow_unused=True)
            out[i, j] = sum(gr.double().pow(2).sum() for gr in grads if gr is not None)  # None: it never trains
    return out


def rule_score(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    rule = rule_for(layer)
    with torch.no_grad():
        y = rule.output(layer(x))
        lead = rule.lead_shape(layer, x, y)
        score = rule.score(layer, rule.capture(layer, x, y), g.to(y.dtype))
    return rule, lead, score


@SETTINGS
@given(kind=st.sampled_from(["column", "row"]), s=st.integers(1, 4), b=st.integers(1, 3),
       d_in=st.integers(1, 6), d_out=st.integers(1, 6), bias=st.booleans(), skip=st.booleans(),
       flag=st.booleans(), frozen=st.sampled_from(["none", "weight", "bias"]),
       scale=st.sampled_from([1e-2, 1.0, 30.0]), seed=st.integers(0, 2**31 - 1))
def test_megatron_linear_matches_per_position_autograd(kind, s, b, d_in, d_out, bias, skip, flag, frozen, scale,
                                                       seed):
    torch.manual_seed(seed)
    layer = _layer(kind, d_in, d_out, bias, skip, flag)
    if frozen == "weight":
        layer.weight.requires_grad_(False)
    if frozen == "bias" and bias:
        layer.bias.requires_grad_(False)
    x = torch.randn(s, b, d_in, dtype=torch.float64) * scale  # [s, b, h]: sequence first
    g = torch.randn(s, b, d_out, dtype=torch.float64)

    rule, lead, score = rule_score(layer, x, g)
    ref = reference(layer, x, g)  # [s, b]

    assert isinstance(rule, MegatronLinearRule)
    assert lead == (b, s)  # the micro-batch's (B, T)
    assert score.dtype == torch.float32 and tuple(score.shape) == (b, s) and score.is_contiguous()
    torch.testing.assert_close(score.double(), ref.t(), rtol=1e-5, atol=1e-9)  # [s, b] -> (b, s)


@pytest.mark.parametrize("skip", [False, True])
def test_row_bias_only_score_is_upstream_norm_at_tp1(skip):
    """W frozen: position p routes g_p itself into ∇b (whether the layer or its caller adds b)."""
    torch.manual_seed(0)
    layer = _layer("row", 5, 3, bias=True, skip=skip, flag=True)
    layer.weight.requires_grad_(False)
    x = torch.randn(4, 2, 5, dtype=torch.float64) * 100.0  # the activations must not matter
    g = torch.randn(4, 2, 3, dtype=torch.float64)
    _, _, score = rule_score(layer, x, g)
    torch.testing.assert_close(score.double(), g.pow(2).sum(-1).t(), rtol=1e-6, atol=0)  # [s, b] -> (b, s)
    torch.testing.assert_close(score.double(), reference(layer, x, g).t(), rtol=1e-6, atol=0)


def test_flattened_rows_are_not_placed():
    """[s·b, h] calls (MoE token rows) have no (b, s): lead () never fits the micro-batch, so the call is
    dropped (and its gradient counted unattributed) rather than placed at the wrong positions."""
    layer = _layer("column", 4, 3, bias=True, skip=False, flag=False)
    y, _ = layer(torch.randn(6, 4, dtype=torch.float64))
    assert rule_for(layer).lead_shape(layer, None, y) == ()


# -- tp > 1 without a collective: one rank's shard, told it is rank r of 2 --------------------------------
def _whole_and_shards(kind: str, d_in: int, d_out: int):
    """A whole layer and the two tp shards of it Megatron would hold (column: output features; row: input
    features, the bias replicated), each shard told which rank of 2 it is."""
    torch.manual_seed(3)
    whole = _layer(kind, d_in, d_out, bias=True, skip=False, flag=True)
    shards = []
    for r in range(2):
        if kind == "column":  # gather_output=True: its output (and gradient) come back whole
            sh = _layer(kind, d_in, d_out // 2, bias=True, skip=False, flag=True)
            rows = slice(r * d_out // 2, (r + 1) * d_out // 2)
            with torch.no_grad():
                sh.weight.copy_(whole.weight[rows])
                sh.bias.copy_(whole.bias[rows])
            sh.output_size = d_out
        else:  # input_is_parallel=False: it receives the whole input and scatters it itself
            sh = _layer(kind, d_in // 2, d_out, bias=True, skip=False, flag=False)
            with torch.no_grad():
                sh.weight.copy_(whole.weight[:, r * d_in // 2:(r + 1) * d_in // 2])
                sh.bias.copy_(whole.bias)
            sh.input_size = d_in
        sh.tp_group = _Group(r, 2)
        shards.append(sh)
    return whole, shards


@pytest.mark.parametrize("kind", ["column", "row"])
def test_two_ranks_shares_add_up_to_the_whole_layer(kind):
    """Column with gather_output=True: the hook's gradient is the whole g_p on both ranks, and each rank must
    score only its own output slice. Row with input_is_parallel=False: the hook's input is the whole a_p, and
    each rank must score only its own input slice; the replicated bias counts 1/2 on each."""
    d_in, d_out = 6, 4
    whole, shards = _whole_and_shards(kind, d_in, d_out)
    x = torch.randn(3, 2, d_in, dtype=torch.float64)  # [s, b, h]: the whole input on every rank
    g = torch.randn(3, 2, d_out, dtype=torch.float64)  # the whole output gradient on every rank
    rule = rule_for(whole)
    per_rank = []
    for r, sh in enumerate(shards):
        with torch.no_grad():  # the hook sees the whole x (row: before the scatter) and the whole g (column)
            per_rank.append(rule.score(sh, rule.capture(sh, x, torch.empty(3, 2, d_out)), g))
        a = x if kind == "column" else x[..., r * d_in // 2:(r + 1) * d_in // 2]  # what r's weight multiplies
        gr = g[..., r * d_out // 2:(r + 1) * d_out // 2] if kind == "column" else g  # what reaches r's weight
        ref = _shard_reference(sh, a, gr, bias_share=1.0 if kind == "column" else 0.5)
        torch.testing.assert_close(per_rank[-1].double(), ref.t(), rtol=1e-6, atol=1e-12)  # rank r's own share
    _, _, full = rule_score(whole, x, g)
    torch.testing.assert_close(per_rank[0] + per_rank[1], full, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(full.double(), reference(whole, x, g).t(), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("kind,gathered", [("column", False), ("column", True), ("row", False)])
def test_head_view_parts_of_u_add_up_to_the_whole_heads(kind, gathered):
    """The per-sample surprise's u_p = −g_p[label_p] (head_read.head_u), read through ``head_view`` on each of two
    ranks' shards of a Megatron LM head, adds up over the ranks to the whole head's read batch-first in one
    process: a column-parallel head's vocabulary shard ([s, b, V/2] from column r·V/2; or the whole gathered output,
    narrowed), a row-parallel head's whole reduced gradient (1/2 each). Labels outside a shard, or -100, read 0."""
    from gradloc.collector.head_read import head_u as _head_u

    d_in, V, s, b = 6, 8, 3, 2
    _, shards = _whole_and_shards(kind, d_in, V)
    g = torch.randn(s, b, V, dtype=torch.float64)  # the head's output gradient, sequence-first
    labels = torch.randint(0, V, (b, s))  # (B, T)
    labels[0, 1] = -100
    rule = rule_for(shards[0])
    parts = []
    for r, sh in enumerate(shards):
        seen = g[..., r * V // 2:(r + 1) * V // 2] if kind == "column" and not gathered else g  # what r's hook gets
        hg, first, share = rule.head_view(sh, seen)
        assert hg.shape[:2] == (b, s)
        parts.append(_head_u(hg, labels, b, s, first, share))
    want = _head_u(g.transpose(0, 1), labels, b, s)  # [s, b, V] -> (B, T, V): the whole head, one process
    torch.testing.assert_close(parts[0] + parts[1], want)
    assert want[0, 1] == 0 and all(p[0, 1] == 0 for p in parts)


def test_backend_reads_the_tp_coordinate_from_the_layers():
    """The Megatron backend takes (rank, size) from the layers (their partition sizes and tp_group), and refuses
    a model whose layers sit on different tp groups; under sequence parallelism it refuses a Megatron layer it
    cannot score there (parallel/megatron_sp.py), naming it."""
    from gradloc.errors import UnsupportedModelError
    from gradloc.parallel.megatron import MegatronTP

    _, (rank0, rank1) = _whole_and_shards("column", 6, 4)  # rank 0 and rank 1 of 2
    backend = MegatronTP.detect(nn.Sequential(rank1, _whole_and_shards("row", 6, 4)[1][1]), world=object())
    assert backend.coords() == {"tp": (1, 2)}
    assert MegatronTP.detect(nn.Sequential(rank1), world=None) is None  # one process: no job to coordinate
    with pytest.raises(UnsupportedModelError, match="different tensor-parallel groups"):
        MegatronTP.detect(nn.Sequential(rank0, rank1), world=object())
    rank1.sequence_parallel = True  # scored from factors combined at the step's token-group all-reduce
    assert MegatronTP.detect(nn.Sequential(rank1), world=object()).sequence_parallel
    emb = mc["layers"].VocabParallelEmbedding(10, 4, init_method=nn.init.zeros_,
                                              config=mc["Config"](use_cpu_initialization=True))
    with pytest.raises(UnsupportedModelError, match=r"1 \(VocabParallelEmbedding\) under Megatron sequence_parallel"):
        MegatronTP.detect(nn.Sequential(rank1, emb), world=object())
    assert not MegatronTP.detect(nn.Sequential(rank0, emb), world=object()).sequence_parallel  # without SP: as before


def _shard_reference(sh: nn.Module, a: torch.Tensor, g: torch.Tensor, bias_share: float) -> torch.Tensor:
    """[s, b] float64: ‖∂/∂W_r‖² + share·‖∂/∂b‖² of ⟨a_p W_rᵀ + b, g_p⟩ for each position, by autograd."""
    s, b = a.shape[:2]
    out = torch.zeros(s, b, dtype=torch.float64)
    for i in range(s):
        for j in range(b):
            w = sh.weight.detach().clone().requires_grad_(True)
            bb = sh.bias.detach().clone().requires_grad_(True)
            y = nn.functional.linear(a[i, j], w, bb)
            gw, gb = torch.autograd.grad((y * g[i, j]).sum(), [w, bb])
            out[i, j] = gw.pow(2).sum() + bias_share * gb.pow(2).sum()
    return out


# -- through the real hooks: a [s, b, h] model, B != T, scores placed at (b, t) ---------------------------
class _SeqFirst(nn.Module):
    """ids (B, T) -> embedding -> [s, b, h] -> column (bias added by the caller) -> GELU -> row -> (B, T, V)."""

    def __init__(self, vocab: int = 11, d: int = 6, f: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.fc1 = _layer("column", d, f, bias=True, skip=True, flag=False, dtype=torch.float32)
        self.fc2 = _layer("row", f, d, bias=True, skip=False, flag=True, dtype=torch.float32)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx).transpose(0, 1)  # (B, T, d) -> [s, b, d]
        h, b1 = self.fc1(x)
        y, _ = self.fc2(nn.functional.gelu(h + b1))
        return self.head((x + y).transpose(0, 1))  # [s, b, d] -> (B, T, d) -> (B, T, V)


def test_hooks_place_sequence_first_scores_at_batch_positions():
    import gradloc

    torch.manual_seed(11)
    B, T, V = 3, 5, 11
    model = _SeqFirst(V)
    idx, tgt = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    seen: dict[str, tuple] = {}

    def keep(name: str):
        def hook(mod, args, out):
            out[0].register_hook(lambda g: seen.__setitem__(name, (args[0].detach(), g.detach())))
        return hook

    handles = [getattr(model, n).register_forward_hook(keep(n)) for n in ("fc1", "fc2")]
    mon = gradloc.watch(model, config=gradloc.WatchConfig(update_ratio=False), store=False)
    try:
        with mon.micro_batch(tgt):
            loss = nn.functional.cross_entropy(model(idx).reshape(B * T, V), tgt.reshape(B * T))
            loss.backward()
        buf = mon._parts[-1][1]
        assert buf.dropped_calls == 0 and buf.hook_errors == 0
        for name in ("fc1", "fc2"):
            x, g = seen[name]  # [s, b, h], [s, b, h_out]
            layer = getattr(model, name)
            twin = copy.deepcopy(layer, memo={id(layer.tp_group): layer.tp_group}).double()  # the group is shared
            ref = reference(twin, x.double(), g.double())  # [s, b]
            got = buf.scores[mon.hooks.layers.index(name)]  # (B, T)
            torch.testing.assert_close(got.double(), ref.t(), rtol=1e-4, atol=1e-10)  # [s, b] -> (B, T)
        tok = mon.end_step(loss.detach()).record.tokens
        assert tok is not None and tok.unattributed_share == pytest.approx(0.0, abs=1e-9)
        assert tok.tokens == B * T and tok.dropped_calls == 0
    finally:
        mon.close()
        for h in handles:
            h.remove()
