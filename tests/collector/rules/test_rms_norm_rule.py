"""RMSNorm per-token rules (torch.nn.RMSNorm by type, HF-style *RMSNorm by shape) vs a brute-force
autograd reference (one weight copy per position)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from gradloc.collector.rules.rms_norm import HFRMSNormRule, TorchRMSNormRule
from tests.collector.rules.reference import (
    SETTINGS,
    LlamaRMSNorm,
    per_position_reference,
    rule_score,
)


def _randomize(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
       feat=st.lists(st.integers(1, 5), min_size=1, max_size=2),
       eps=st.sampled_from([None, 1e-6, 1e-2]), affine=st.booleans(),
       dtype=st.sampled_from([torch.float64, torch.float32]),
       scale=st.sampled_from([0.05, 1.0, 20.0]), seed=st.integers(0, 2**31 - 1))
def test_torch_rms_norm_matches_per_position_autograd(lead, feat, eps, affine, dtype, scale, seed):
    torch.manual_seed(seed)
    norm = nn.RMSNorm(feat, eps=eps, elementwise_affine=affine).to(dtype)
    _randomize(norm)
    x = (torch.randn(*lead, *feat, dtype=torch.float64) * scale).to(dtype)
    g = torch.randn(*lead, *feat, dtype=torch.float64).to(dtype)

    rule, got_lead, _, score = rule_score(norm, x, g)
    ref = per_position_reference(norm, x, g, n_feat=len(feat))

    assert isinstance(rule, TorchRMSNormRule)
    assert got_lead == tuple(lead)
    assert score.dtype == torch.float32 and tuple(score.shape) == tuple(lead)
    if not affine:
        assert torch.equal(score, torch.zeros(tuple(lead)))
    tol = 2e-5 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(score.double(), ref, rtol=tol, atol=1e-7)


@pytest.mark.parametrize("eps", [None, 1e-5])
def test_torch_rms_norm_bf16_input(eps):
    """Small activations make the epsilon matter: with eps=None torch uses float32's epsilon for bf16 input."""
    torch.manual_seed(5)
    norm = nn.RMSNorm(16, eps=eps).bfloat16()
    _randomize(norm)
    x = (torch.randn(3, 4, 16) * 0.05).bfloat16()
    g = torch.randn(3, 4, 16).bfloat16()
    _, _, _, score = rule_score(norm, x, g)
    ref = per_position_reference(norm, x, g, 1)  # autograd in bf16
    torch.testing.assert_close(score.double(), ref, rtol=3e-2, atol=1e-4)


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=3), dim=st.integers(1, 8),
       eps=st.sampled_from([1e-6, 1e-2]), dtype=st.sampled_from([torch.float64, torch.float32]),
       scale=st.sampled_from([0.05, 1.0, 20.0]), seed=st.integers(0, 2**31 - 1))
def test_hf_rms_norm_matches_per_position_autograd(lead, dim, eps, dtype, scale, seed):
    torch.manual_seed(seed)
    norm = LlamaRMSNorm(dim, eps).to(dtype)
    _randomize(norm)
    x = (torch.randn(*lead, dim, dtype=torch.float64) * scale).to(dtype)
    g = torch.randn(*lead, dim, dtype=torch.float64).to(dtype)

    rule, got_lead, _, score = rule_score(norm, x, g)
    ref = per_position_reference(norm, x, g, n_feat=1)

    assert isinstance(rule, HFRMSNormRule)
    assert got_lead == tuple(lead)
    assert score.dtype == torch.float32 and tuple(score.shape) == tuple(lead)
    torch.testing.assert_close(score.double(), ref, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_hf_rms_norm_bf16_input(weight_dtype):
    """bf16 activations (weight in bf16 as in a bf16 checkpoint, or kept in fp32): x̂ is rounded to bf16
    before the weight multiply, as HF does."""
    torch.manual_seed(6)
    norm = LlamaRMSNorm(32, 1e-6).to(weight_dtype)
    _randomize(norm)
    x = (torch.randn(2, 5, 32) * 3).bfloat16()
    y_dtype = torch.promote_types(weight_dtype, torch.bfloat16)
    g = torch.randn(2, 5, 32).to(y_dtype)
    _, _, y, score = rule_score(norm, x, g)
    assert y.dtype == y_dtype
    ref = per_position_reference(norm, x, g, 1)
    tol = 3e-2 if weight_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(score.double(), ref, rtol=tol, atol=1e-4)


def test_hf_rms_norm_frozen_weight_scores_zero():
    norm = LlamaRMSNorm(4).double()
    norm.weight.requires_grad_(False)
    _, _, _, score = rule_score(norm, torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))
    assert torch.equal(score, torch.zeros(3))


# -- exact case through the real hooks: the final norm ---------------------------------------------
def _token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    B, T, V = logits.shape
    return nn.functional.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), reduction="none").view(B, T)


class HFStyleLM(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.mlp = nn.Linear(d, d)
        self.norm = LlamaRMSNorm(d, 1e-6)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(idx)
        h = h + torch.relu(self.mlp(h)).cumsum(1)  # positions interact
        return self.lm_head(self.norm(h))


@pytest.mark.parametrize("kind", ["torch", "hf"])
def test_final_rms_norm_scores_through_hooks_equal_per_token_loss_gradients(kind):
    """ℓ_p reaches the final norm's weight only through its output at p: score_p = ‖∇_w ℓ_p‖² exactly."""
    import gradloc
    from gradloc.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(11)
    B, T, V = 2, 5, 11
    if kind == "torch":
        model = TinyGPT(GPTConfig(vocab=V, seq=T, d_model=8, n_layers=1, n_heads=2, norm="rms"))
        norm_name, norm = "ln_f", model.ln_f
    else:
        model = HFStyleLM(V, 8)
        norm_name, norm = "norm", model.norm
    _randomize(norm)
    idx, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    terms = _token_ce(model(idx), targets) / (B * T)
    ref = torch.zeros(B, T)
    for b in range(B):
        for t in range(T):
            (gw,) = torch.autograd.grad(terms[b, t], [norm.weight], retain_graph=True)
            ref[b, t] = gw.pow(2).sum()

    mon = gradloc.watch(model, config=gradloc.WatchConfig(update_ratio=False))
    try:
        assert norm_name in mon.hooks.layers
        with mon.micro_batch(targets):
            _token_ce(model(idx), targets).mean().backward()
        buf = mon._parts[-1][1]
        assert buf.hook_errors == 0 and buf.dropped_calls == 0
        torch.testing.assert_close(buf.scores[mon.hooks.layers.index(norm_name)], ref, rtol=1e-4, atol=1e-10)
        report = mon.end_step()
        assert report.record.tokens.unattributed_share == 0.0  # every parameter has a rule
    finally:
        mon.close()


def test_hf_rms_norm_with_zero_epsilon_keeps_zero():
    """variance_epsilon = 0.0 is a real value, not a missing one (no silent fallback to 1e-6)."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(4, eps=0.0).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 4, dtype=torch.float64) * 1e-4  # small activations: eps would dominate
    g = torch.randn(3, 4, dtype=torch.float64)
    _, _, _, score = rule_score(norm, x, g)
    torch.testing.assert_close(score.double(), per_position_reference(norm, x, g, 1), rtol=1e-5, atol=0)
