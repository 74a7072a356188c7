"""Megatron sequence parallelism's per-token pieces (gradloc/parallel/megatron_sp.py) against a brute-force
autograd reference, in one process, without megatron.

Two tp ranks are simulated: each holds a stand-in for its ``ColumnParallelLinear`` / ``RowParallelLinear`` shard
(a class of that name in a ``megatron.*`` module, as the backend recognises them; its forward does what the real
layer's does under SP — the column layer's input all-gathered inside, the row layer's output reduce-scattered —
on tensors both "ranks" see here, so no collective runs). Each rank's ``SPLinearRule`` captures its own call into
its own micro-batch buffer, backward delivers each rank's output gradient, and the two ranks' stacked steps are
summed the way the token group's all-reduce sums them (``tokens.combine`` on a stand-in communicator adding the
ranks' vectors) — which is where the factors are multiplied.

Reference: every position p gets a private copy of the whole (unpartitioned) weight and bias, the layer runs on
a_p alone, ⟨y_p, g_p⟩ is backpropagated, and p's score is Σ ‖∂/∂θ_p‖². Nothing of the closed form is used.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gradloc.collector.batch import MicroBatchMeta, RngState
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.collector.token_summary import stack_step
from gradloc.collector.watched import WatchedModule
from gradloc.errors import UnsupportedModelError
from gradloc.parallel.megatron_sp import SPLinearRule, SPShardRule, check_model
from gradloc.parallel.tokens import combine

TP, S, Bn, H, O = 2, 6, 3, 5, 4  # noqa: E741 (O: output features)  S != Bn: a transposed factor would not fit


def _standin(kind: str, w: torch.Tensor, b: torch.Tensor | None, size: int, rank: int) -> nn.Module:
    """A rank's shard of the layer, as the rule reads it (sizes, weight, bias, sequence_parallel)."""
    cls = type(kind, (nn.Module,), {"__module__": "megatron.core.tensor_parallel.layers"})
    m = cls()
    m.weight = nn.Parameter(w.clone())
    m.bias = nn.Parameter(b.clone()) if b is not None else None
    m.sequence_parallel, m.skip_bias_add, m.tp_group = True, False, None
    if kind == "ColumnParallelLinear":
        m.output_size, m.output_size_per_partition = w.shape[0] * size, w.shape[0]
    else:
        m.input_size, m.input_size_per_partition = w.shape[1] * size, w.shape[1]
    return m


def _reference(W: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-position Σ ‖∂⟨W_p a_p + b_p, g_p⟩/∂θ_p‖², private copies per position: (b, s)."""
    out = torch.zeros(a.shape[1], a.shape[0], dtype=torch.float64)
    for s in range(a.shape[0]):
        for bi in range(a.shape[1]):
            Wp = W.clone().double().requires_grad_(True)
            bp = bias.clone().double().requires_grad_(True) if bias is not None else None
            y = a[s, bi].double() @ Wp.t() + (bp if bp is not None else 0.0)
            params = [Wp] + ([bp] if bp is not None else [])
            grads = torch.autograd.grad((y * g[s, bi].double()).sum(), params)
            out[bi, s] = sum(float(x.pow(2).sum()) for x in grads)
    return out


class _Sum:
    """The token group's all-reduce for simulated ranks: pass 1 records each rank's vector, pass 2 returns the sum."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.total: torch.Tensor | None = None

    def all_reduce(self, t: torch.Tensor, what: str = "") -> torch.Tensor:
        if self.total is None:
            self.seen.append(t.clone())
            return t
        return self.total.clone()


def _run_ranks(kind: str, bias: bool) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The whole layer's reference scores (b, s) and each simulated rank's combined StepScores."""
    torch.manual_seed(0)
    W = torch.randn(O, H, dtype=torch.float64)
    bvec = torch.randn(O, dtype=torch.float64) if bias else None
    a = torch.randn(S, Bn, H, dtype=torch.float64)  # the whole sequence's input [s, b, h]
    g = torch.randn(S, Bn, O, dtype=torch.float64)  # the whole output's gradient [s, b, o]
    n = S // TP
    steps = []
    for r in range(TP):
        if kind == "ColumnParallelLinear":  # W split by output features; the input a sequence shard, gathered inside
            rows = slice(r * O // TP, (r + 1) * O // TP)
            mod = _standin(kind, W[rows], bvec[rows] if bias else None, TP, r)
            shard = a[r * n:(r + 1) * n].clone().requires_grad_(True)
            gathered = torch.cat([a[:r * n], shard, a[(r + 1) * n:]])  # [s/tp, b, h] -> [s, b, h]
            y = gathered @ mod.weight.t() + (mod.bias if bias else 0.0)  # [s, b, o/tp]
            x, gy = shard, g[..., rows]
        else:  # W split by input features; the whole sequence's input slice; the output reduce-scattered
            cols = slice(r * H // TP, (r + 1) * H // TP)
            mod = _standin(kind, W[:, cols], bvec, TP, r)
            x = a[..., cols].clone().requires_grad_(True)
            whole = x @ mod.weight.t() + sum((a[..., c] @ W[:, c].t() for c in _other(cols)), torch.zeros(()))
            y = whole[r * n:(r + 1) * n] + (mod.bias if bias else 0.0)  # [s/tp, b, o]: this rank's positions
            gy = g[r * n:(r + 1) * n]
        buf = MicroBatchScores(index=0, batch=Bn, seq=S, n_layers=1)
        rule = SPLinearRule(0, r, TP)
        w = WatchedModule("lin", mod, rule, 0, mod)
        rule.capture_routed(w, buf, (x,), (y, None))
        y.backward(gy)
        meta = MicroBatchMeta(index=0, batch=Bn, seq=S, token_ids=None, loss_mask=None, sample_ids=None,
                              rng=RngState.capture())
        steps.append(stack_step([(meta, buf)], 1, torch.device("cpu"), frozenset({"lin"}), pair_slots=1))
    token = _Sum()
    for st in steps:  # pass 1: every rank's vector
        combine(st, token, 1, True, True, TP)
    token.total = sum(token.seen)
    combined = [combine(st, token, 1, True, True, TP) for st in steps]
    return _reference(W, bvec, a, g), combined, steps


def _other(cols: slice) -> list[slice]:
    step = cols.stop - cols.start
    return [slice(c, c + step) for c in range(0, H, step) if c != cols.start]


@pytest.mark.parametrize("kind", ["ColumnParallelLinear", "RowParallelLinear"])
@pytest.mark.parametrize("bias", [True, False])
def test_combined_factors_equal_per_position_autograd(kind: str, bias: bool) -> None:
    want, combined, steps = _run_ranks(kind, bias)
    for st, got in zip(steps, combined):
        assert st.pairs is not None and st.pairs.shape == (1, 2, Bn * S)
        assert not st.unscored_modules  # the module's score arrived (its factors)
        assert got.pairs is None  # multiplied in the combine
        flat = want.reshape(-1).float()  # (b, s) -> (b·s,)
        assert torch.allclose(got.totals, flat, rtol=1e-5, atol=1e-6)
        assert torch.allclose(got.per_layer[0], flat, rtol=1e-5, atol=1e-6)
        assert torch.allclose(got.exact, flat, rtol=1e-5, atol=1e-6)  # the last layer called: the exact row


def test_one_rank_product_alone_is_not_the_score() -> None:
    """The factors must be summed before they are multiplied: a rank's own product is not its share."""
    want, _, steps = _run_ranks("ColumnParallelLinear", False)
    own = steps[0].pairs[0, 0] * steps[0].pairs[0, 1] + steps[1].pairs[0, 0] * steps[1].pairs[0, 1]
    assert not torch.allclose(own, want.reshape(-1).float(), rtol=1e-3)


def test_norm_scores_its_own_positions_once() -> None:
    """A LayerNorm marked sequence_parallel on rank r's positions (b, s/tp, h): its rule's score placed there."""
    from gradloc.collector.rules import rule_for

    ln = nn.LayerNorm(H)
    n = S // TP
    for r in range(TP):
        buf = MicroBatchScores(index=0, batch=Bn, seq=S, n_layers=1)
        rule = SPShardRule(rule_for(ln), r, TP)
        x = torch.randn(Bn, n, H, requires_grad=True)
        y = ln(x)
        rule.capture_routed(WatchedModule("ln", ln, rule, 0, ln), buf, (x,), y)
        g = torch.randn_like(y)
        y.backward(g)
        whole = rule_for(ln).score(ln, x.detach(), g)  # (b, s/tp)
        assert torch.equal(buf.scores[0][:, r * n:(r + 1) * n], whole)
        assert float(buf.scores[0].sum()) == pytest.approx(float(whole.sum()))  # nothing outside its positions


def test_refused_at_attach() -> None:
    mega = type("VocabParallelEmbedding", (nn.Module,), {"__module__": "megatron.core.tensor_parallel.layers"})
    emb = mega()
    emb.weight = nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(UnsupportedModelError, match="VocabParallelEmbedding.*does not score under sequence"):
        check_model(nn.Sequential(emb))
    mixed = nn.LayerNorm(H)
    mixed.weight.sequence_parallel = True
    with pytest.raises(UnsupportedModelError, match="some of its parameters are marked sequence_parallel"):
        check_model(nn.Sequential(mixed))
    odd = nn.Conv1d(2, 2, 1)
    for p in odd.parameters():
        p.sequence_parallel = True
    with pytest.raises(UnsupportedModelError, match="no norm rule"):
        check_model(nn.Sequential(odd))
    with pytest.raises(UnsupportedModelError, match="pipeline parallelism"):
        check_model(nn.Module(), pp=2)
    ok = nn.LayerNorm(H)
    for p in ok.parameters():
        p.sequence_parallel = True
    check_model(nn.Sequential(ok, nn.Linear(2, 2)))  # SP norms and replicated modules: accepted
