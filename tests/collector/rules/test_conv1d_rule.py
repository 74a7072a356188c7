"""Hugging Face Conv1D per-token rule (duck-typed) vs a brute-force autograd reference.

Reference: every position p gets its own private copy (W_p, b_p) of the parameters, y_p is computed
with that copy through the module's own forward, ⟨y, G⟩ is backpropagated for a random upstream
gradient G, and the score of p is Σ ‖∂/∂θ_p‖². Nothing of the rule's closed form is used. The module
is transformers' real ``Conv1D``; a local class of the same name covers the bias-free variant (HF's
forward always adds its bias) and the duck-typing checks.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from gradloc.collector.rules import rule_for
from gradloc.collector.rules.conv1d import Conv1DRule
from gradloc.collector.token_hooks import TokenHooks
from tests.collector.rules.reference import SETTINGS, per_position_reference, rule_score

HFConv1D = transformers.pytorch_utils.Conv1D


class Conv1D(nn.Module):
    """Same name and weight layout as HF's Conv1D (W: (nx, nf)); optional bias; not from transformers."""

    def __init__(self, nf: int, nx: int, bias: bool = True) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight  # (*lead, nx) -> (*lead, nf)
        return y + self.bias if self.bias is not None else y


def _conv(kind: str, nf: int, nx: int, dtype: torch.dtype) -> nn.Module:
    conv = HFConv1D(nf, nx) if kind == "hf" else Conv1D(nf, nx, bias=kind == "local")
    with torch.no_grad():  # HF initialises the bias to 0 and W with std 0.02: make both matter
        for p in conv.parameters():
            p.normal_()
    return conv.to(dtype)


leads = st.lists(st.integers(1, 4), min_size=0, max_size=3)  # 0..3 leading (position) dims


@SETTINGS
@given(lead=leads, nx=st.integers(1, 6), nf=st.integers(1, 6), kind=st.sampled_from(["hf", "local", "local-no-bias"]),
       frozen=st.sampled_from(["none", "weight", "bias"]), scale=st.sampled_from([1e-2, 1.0, 30.0]),
       seed=st.integers(0, 2**31 - 1))
def test_conv1d_matches_per_position_autograd(lead, nx, nf, kind, frozen, scale, seed):
    torch.manual_seed(seed)
    conv = _conv(kind, nf, nx, torch.float64)
    if frozen == "weight":
        conv.weight.requires_grad_(False)
    if frozen == "bias" and conv.bias is not None:
        conv.bias.requires_grad_(False)
    x = torch.randn(*lead, nx, dtype=torch.float64) * scale
    g = torch.randn(*lead, nf, dtype=torch.float64)

    rule, got_lead, y, score = rule_score(conv, x, g)
    ref = per_position_reference(conv, x, g, n_feat=1)

    assert isinstance(rule, Conv1DRule)
    assert tuple(y.shape) == (*lead, nf)
    assert got_lead == tuple(lead)
    assert score.dtype == torch.float32 and tuple(score.shape) == tuple(lead)
    torch.testing.assert_close(score.double(), ref, rtol=1e-5, atol=1e-9)


def test_conv1d_bias_only_score_is_upstream_norm():
    """With W frozen, position p's contribution is g_p itself (into ∇b): the activations must not matter."""
    torch.manual_seed(0)
    conv = _conv("hf", 3, 5, torch.float64)
    conv.weight.requires_grad_(False)
    x = torch.randn(4, 5, dtype=torch.float64) * 100.0
    g = torch.randn(4, 3, dtype=torch.float64)
    _, _, _, score = rule_score(conv, x, g)
    torch.testing.assert_close(score.double(), per_position_reference(conv, x, g, 1), rtol=1e-6, atol=0)
    assert not torch.allclose(score.double(), g.pow(2).sum(-1) * x.pow(2).sum(-1))


def test_conv1d_fully_frozen_scores_zero():
    conv = _conv("hf", 2, 3, torch.float64).requires_grad_(False)
    x, g = torch.randn(2, 4, 3, dtype=torch.float64), torch.randn(2, 4, 2, dtype=torch.float64)
    _, _, _, score = rule_score(conv, x, g)
    assert torch.equal(score, torch.zeros(2, 4))


def test_conv1d_single_position_score_is_the_full_gradient_norm():
    """One position: the score is exactly ‖∇W‖² + ‖∇b‖² of the whole (one-term) loss."""
    torch.manual_seed(1)
    conv = _conv("hf", 3, 4, torch.float64)
    x = torch.randn(1, 4, dtype=torch.float64)
    g = torch.randn(1, 3, dtype=torch.float64)
    (conv(x) * g).sum().backward()
    full = conv.weight.grad.pow(2).sum() + conv.bias.grad.pow(2).sum()
    _, _, _, score = rule_score(conv, x, g)
    torch.testing.assert_close(score.double().sum(), full, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conv1d_low_precision_input(dtype):
    torch.manual_seed(2)
    conv = _conv("hf", 6, 8, dtype)
    x = torch.randn(3, 5, 8).to(dtype)
    g = torch.randn(3, 5, 6).to(dtype)
    _, _, _, score = rule_score(conv, x, g)
    assert score.dtype == torch.float32 and torch.isfinite(score).all()
    conv64 = HFConv1D(6, 8).double()
    conv64.load_state_dict({k: v.double() for k, v in conv.state_dict().items()})
    ref = per_position_reference(conv64, x.double(), g.double(), 1)
    torch.testing.assert_close(score.double(), ref, rtol=1e-4, atol=1e-6)


# -- recognition by shape ----------------------------------------------------------------------------
class _Named(nn.Module):
    def __init__(self, weight_shape: tuple[int, ...], nf: object, nx: object = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(weight_shape))
        self.nf = nf
        if nx is not None:
            self.nx = nx


def _renamed(name: str, **kw) -> nn.Module:
    return type(name, (_Named,), {})(**kw)


@pytest.mark.parametrize("module, expected", [
    (HFConv1D(4, 3), True),
    (Conv1D(4, 3), True),
    (Conv1D(4, 3, bias=False), True),
    (_renamed("Conv1D", weight_shape=(3, 4), nf=4), True),  # no nx attribute: W's rows are nx
    (_renamed("Conv1D", weight_shape=(3, 4), nf=3), False),  # nf is not W's column count (nn.Linear layout)
    (_renamed("Conv1D", weight_shape=(3, 4), nf=4, nx=4), False),  # nx disagrees with W
    (_renamed("Conv1D", weight_shape=(3, 4, 1), nf=4), False),  # 3-D weight
    (_renamed("Conv1D", weight_shape=(3, 4), nf=None), False),  # no nf
    (_renamed("Projection", weight_shape=(3, 4), nf=4), False),  # right shape, other name
    (nn.Conv1d(3, 4, 1), False),  # torch's convolution, 3-D weight
], ids=["hf", "local", "local-no-bias", "no-nx", "nf-mismatch", "nx-mismatch", "3d", "no-nf", "other-name",
        "nn.Conv1d"])
def test_conv1d_recognised_by_shape(module, expected):
    assert isinstance(rule_for(module), Conv1DRule) is expected


class _ShapeLiar(Conv1D):
    """Named Conv1D, weight (nx, nf), but its forward keeps only the first output feature."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[..., :1]  # (*lead, nf) -> (*lead, 1)


_ShapeLiar.__name__ = "Conv1D"


def test_conv1d_call_that_contradicts_the_weight_is_a_counted_hook_error():
    """A module that passes the shape check but maps other feature sizes is not scored (a wrong score
    would be silent); the call is counted in the buffer and nothing is raised into the forward."""
    torch.manual_seed(3)
    model = nn.Sequential(Conv1D(4, 3), _ShapeLiar(4, 4))
    hooks = TokenHooks(model, {})
    assert [w.name for w in hooks.watched] == ["0", "1"]
    hooks.attach()
    try:
        hooks.begin(0, 2, 5)
        model(torch.randn(2, 5, 3)).sum().backward()
        buf = hooks.end()
    finally:
        hooks.detach()
    assert buf.hook_errors == 1 and buf.matched_calls == 1 and buf.dropped_calls == 0
    assert buf.scores[0].gt(0).all() and torch.equal(buf.scores[1], torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"weight \(4, 4\) mapped \(2, 5, 4\) to \(2, 5, 1\)"):
        Conv1DRule().lead_shape(model[1], torch.randn(2, 5, 4), torch.randn(2, 5, 1))
