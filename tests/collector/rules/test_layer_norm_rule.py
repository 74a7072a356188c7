"""nn.LayerNorm per-token rule vs a brute-force autograd reference (one (w, b) copy per position)."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from gradloc.collector.rules.layer_norm import LayerNormRule
from tests.collector.rules.reference import SETTINGS, per_position_reference, rule_score


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
       feat=st.lists(st.integers(1, 5), min_size=1, max_size=2),
       affine=st.sampled_from(["weight+bias", "weight", "none", "frozen-weight", "frozen-bias"]),
       eps=st.sampled_from([1e-5, 1e-2]), scale=st.sampled_from([0.1, 1.0, 20.0]),
       shift=st.sampled_from([0.0, 3.0]), seed=st.integers(0, 2**31 - 1))
def test_layer_norm_matches_per_position_autograd(lead, feat, affine, eps, scale, shift, seed):
    torch.manual_seed(seed)
    ln = nn.LayerNorm(feat, eps=eps, elementwise_affine=affine != "none", bias=affine != "weight").double()
    if ln.weight is not None:
        with torch.no_grad():  # move away from the (1, 0) init so the weight matters
            ln.weight.normal_()
            if ln.bias is not None:
                ln.bias.normal_()
    if affine == "frozen-weight":
        ln.weight.requires_grad_(False)
    if affine == "frozen-bias":
        ln.bias.requires_grad_(False)
    x = torch.randn(*lead, *feat, dtype=torch.float64) * scale + shift
    g = torch.randn(*lead, *feat, dtype=torch.float64)

    rule, got_lead, _, score = rule_score(ln, x, g)
    ref = per_position_reference(ln, x, g, n_feat=len(feat))

    assert isinstance(rule, LayerNormRule)
    assert got_lead == tuple(lead)
    assert score.dtype == torch.float32 and tuple(score.shape) == tuple(lead)
    # The rule normalizes in float32 (as fused kernels do): rounding x to float32 moves x − μ by about
    # ulp(max|x|), relative to x − μ's own size σ — not sqrt(var + eps): eps damps x̂, not that relative error —
    # so the tolerance grows with the condition number κ = max|x| / σ (shift 3, scale 0.1 and two features can
    # make σ tiny against |x|). With sqrt(var + eps), hypothesis found cases at 19 and 48 κ·2⁻²⁴ (eps 0.01 ≫ var);
    # with σ, 12,000 examples at 16 κ·2⁻²⁴ passed (2026-12-01).
    dims = tuple(range(x.dim() - len(feat), x.dim()))
    var = x.var(dim=dims, unbiased=False) if x.dim() else x.new_zeros(())
    # a single feature: x − μ is exactly 0 in float32 too (no error to allow for): κ 1, the check kept
    cond = torch.where(var > 0, x.abs().amax(dim=dims) / var.clamp_min(1e-300).sqrt(), torch.ones_like(var))
    kappa = float(cond.max()) if dims else 1.0
    torch.testing.assert_close(score.double(), ref, rtol=max(2e-5, 16 * kappa * 2.0 ** -24), atol=1e-8)


def test_layer_norm_without_affine_scores_zero():
    ln = nn.LayerNorm(4, elementwise_affine=False).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    _, lead, _, score = rule_score(ln, x, torch.randn(2, 3, 4, dtype=torch.float64))
    assert lead == (2, 3) and torch.equal(score, torch.zeros(2, 3))


def test_layer_norm_two_dim_normalized_shape_lead():
    ln = nn.LayerNorm((3, 4)).double()
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    g = torch.randn_like(x)
    _, lead, _, score = rule_score(ln, x, g)
    assert lead == (2, 5)
    torch.testing.assert_close(score.double(), per_position_reference(ln, x, g, 2), rtol=2e-5, atol=1e-8)


def test_layer_norm_bf16_input_loose():
    torch.manual_seed(4)
    ln = nn.LayerNorm(16).bfloat16()
    with torch.no_grad():
        ln.weight.normal_()
    x = (torch.randn(3, 4, 16) * 2 + 1).bfloat16()
    g = torch.randn(3, 4, 16).bfloat16()
    _, _, _, score = rule_score(ln, x, g)
    ref = per_position_reference(ln, x, g, 1)  # autograd in bf16
    assert torch.isfinite(score).all() and (score > 0).all()
    torch.testing.assert_close(score.double(), ref, rtol=3e-2, atol=1e-3)


# -- exact case through the real hooks: the final norm ---------------------------------------------
def _token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    B, T, V = logits.shape
    return nn.functional.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), reduction="none").view(B, T)


def test_final_layer_norm_scores_through_hooks_equal_per_token_loss_gradients():
    """ℓ_p reaches ln_f's (w, b) only through ln_f's output at p, so score_p = ‖∇_{w,b} ℓ_p‖² exactly."""
    import gradloc
    from gradloc.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(10)
    B, T, V = 2, 5, 11
    model = TinyGPT(GPTConfig(vocab=V, seq=T, d_model=8, n_layers=2, n_heads=2, norm="layer"))
    with torch.no_grad():
        model.ln_f.weight.normal_()
        model.ln_f.bias.normal_()
    idx, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    params = [model.ln_f.weight, model.ln_f.bias]
    terms = _token_ce(model(idx), targets) / (B * T)
    ref = torch.zeros(B, T)
    for b in range(B):
        for t in range(T):
            grads = torch.autograd.grad(terms[b, t], params, retain_graph=True)
            ref[b, t] = sum(g.pow(2).sum() for g in grads)

    mon = gradloc.watch(model, config=gradloc.WatchConfig(update_ratio=False))
    try:
        with mon.micro_batch(targets):
            _token_ce(model(idx), targets).mean().backward()
        buf = mon._parts[-1][1]
        assert buf.hook_errors == 0 and buf.dropped_calls == 0
        torch.testing.assert_close(buf.scores[mon.hooks.layers.index("ln_f")], ref, rtol=1e-4, atol=1e-10)
        assert {"blocks.0.ln1", "blocks.1.ln2"} <= set(mon.hooks.layers)  # inner norms are watched too
    finally:
        mon.close()
