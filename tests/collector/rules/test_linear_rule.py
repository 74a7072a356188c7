"""nn.Linear per-token rule vs a brute-force autograd reference.

Reference: every position p gets its own private copy (W_p, b_p) of the parameters, y_p is computed
with that copy, ⟨y, G⟩ is backpropagated for a random upstream gradient G, and the score of p is
Σ ‖∂/∂θ_p‖². Nothing of the rule's closed form (‖g‖²·‖a‖²) is used.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from gradloc.collector.rules.linear import LinearRule
from tests.collector.rules.reference import SETTINGS, per_position_reference, rule_score

leads = st.lists(st.integers(1, 4), min_size=0, max_size=3)  # 0..3 leading (position) dims








@SETTINGS
@given(lead=leads, d_in=st.integers(1, 6), d_out=st.integers(1, 6), bias=st.booleans(),
       frozen=st.sampled_from(["none", "weight", "bias"]), scale=st.sampled_from([1e-2, 1.0, 30.0]),
       seed=st.integers(0, 2**31 - 1))
def test_linear_matches_per_position_autograd(lead, d_in, d_out, bias, frozen, scale, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(d_in, d_out, bias=bias).double()
    if frozen == "weight":
        lin.weight.requires_grad_(False)
    if frozen == "bias" and bias:
        lin.bias.requires_grad_(False)
    x = torch.randn(*lead, d_in, dtype=torch.float64) * scale
    g = torch.randn(*lead, d_out, dtype=torch.float64)

    rule, got_lead, _, score = rule_score(lin, x, g)
    ref = per_position_reference(lin, x, g, n_feat=1)

    assert isinstance(rule, LinearRule)
    assert got_lead == tuple(lead)
    assert score.dtype == torch.float32 and tuple(score.shape) == tuple(lead)
    torch.testing.assert_close(score.double(), ref, rtol=1e-5, atol=1e-9)


def test_linear_fully_frozen_scores_zero():
    lin = nn.Linear(3, 2).double().requires_grad_(False)
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    _, _, _, score = rule_score(lin, x, torch.randn(2, 4, 2, dtype=torch.float64))
    assert torch.equal(score, torch.zeros(2, 4))


def test_linear_bias_only_score_is_upstream_norm():
    """With W frozen, position p's contribution is g_p itself (into ∇b): checked against autograd."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 3).double()
    lin.weight.requires_grad_(False)
    x = torch.randn(4, 5, dtype=torch.float64) * 100.0  # the activations must not matter
    g = torch.randn(4, 3, dtype=torch.float64)
    _, _, _, score = rule_score(lin, x, g)
    torch.testing.assert_close(score.double(), per_position_reference(lin, x, g, 1), rtol=1e-6, atol=0)
    assert not torch.allclose(score.double(), g.pow(2).sum(-1) * x.pow(2).sum(-1))


def test_linear_scores_sum_to_gradient_norm_for_a_single_position():
    """One position: the score is exactly ‖∇W‖² + ‖∇b‖² of the whole (one-term) loss."""
    torch.manual_seed(1)
    lin = nn.Linear(4, 3).double()
    x = torch.randn(1, 4, dtype=torch.float64)
    g = torch.randn(1, 3, dtype=torch.float64)
    (lin(x) * g).sum().backward()
    full = lin.weight.grad.pow(2).sum() + lin.bias.grad.pow(2).sum()
    _, _, _, score = rule_score(lin, x, g)
    torch.testing.assert_close(score.double().sum(), full, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_low_precision_input(dtype):
    torch.manual_seed(2)
    lin64 = nn.Linear(8, 6).double()
    lin = nn.Linear(8, 6).to(dtype)
    lin.load_state_dict({k: v.to(dtype) for k, v in lin64.state_dict().items()})
    x = torch.randn(3, 5, 8).to(dtype)
    g = torch.randn(3, 5, 6).to(dtype)
    _, _, _, score = rule_score(lin, x, g)
    assert score.dtype == torch.float32 and torch.isfinite(score).all()
    lin64.load_state_dict({k: v.double() for k, v in lin.state_dict().items()})
    ref = per_position_reference(lin64, x.double(), g.double(), 1)
    torch.testing.assert_close(score.double(), ref, rtol=1e-4, atol=1e-6)


# -- exact case through the real hooks: the LM head ----------------------------------------------------
def _token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    B, T, V = logits.shape
    return nn.functional.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), reduction="none").view(B, T)


@pytest.mark.parametrize("n_micro", [1, 2])
def test_lm_head_scores_through_hooks_equal_per_token_loss_gradients(n_micro):
    """For the final nn.Linear, position p's score is exactly ‖∇_W ℓ_p‖² (ℓ_p = p's term of the loss),
    computed here by backpropagating every token's loss term on its own."""
    import gradloc
    from gradloc.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(7)
    B, T, V = 2, 5, 13
    # float32: a float64 model cannot go through end_step (see test_bad_input.py::test_float64_model_end_step)
    model = TinyGPT(GPTConfig(vocab=V, seq=T, d_model=8, n_layers=1, n_heads=2))
    batches = [(torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))) for _ in range(n_micro)]

    refs = []
    for idx, targets in batches:
        terms = _token_ce(model(idx), targets) / (B * T)  # loss = mean, so ℓ_p carries the 1/N
        ref = torch.zeros(B, T)
        total = torch.zeros_like(model.head.weight)
        for b in range(B):
            for t in range(T):
                (gw,) = torch.autograd.grad(terms[b, t], [model.head.weight], retain_graph=True)
                ref[b, t] = gw.pow(2).sum()
                total += gw
        (gw_all,) = torch.autograd.grad(terms.sum(), [model.head.weight])
        torch.testing.assert_close(total, gw_all)  # the per-token terms add up to the batch gradient
        refs.append(ref)

    mon = gradloc.watch(model, config=gradloc.WatchConfig(update_ratio=False))
    try:
        head = mon.hooks.layers.index("head")
        losses = []
        for (idx, targets), ref in zip(batches, refs):
            with mon.micro_batch(targets):
                loss = _token_ce(model(idx), targets).mean()
                loss.backward()
            losses.append(loss.detach())
            buf = mon._parts[-1][1]
            assert buf.scores is not None and tuple(buf.scores.shape) == (len(mon.hooks.layers), B, T)
            assert buf.dropped_calls == 0 and buf.hook_errors == 0
            torch.testing.assert_close(buf.scores[head], ref, rtol=1e-4, atol=1e-10)
        all_scores = torch.cat([s.scores for _, s in mon._parts], dim=1)  # (L, M·B, T)
        report = mon.end_step(torch.stack(losses).mean())
        tok = report.record.tokens
        assert tok is not None and tok.tokens == n_micro * B * T and tok.dropped_calls == 0
        assert tok.total_score == pytest.approx(float(all_scores.double().sum()), rel=1e-5)
        assert tok.top[0].score == pytest.approx(float(all_scores.double().sum(0).max()), rel=1e-5)
    finally:
        mon.close()
