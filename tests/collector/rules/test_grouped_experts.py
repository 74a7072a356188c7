"""torchtitan-style grouped experts (rules/grouped_experts.py) against per-token autograd: a plain-torch
module of the same layout in float64 (no torchtitan needed, exact), and torchtitan 0.3.0's own
``RoutedExperts`` (its dispatcher and bf16 grouped matmuls); a torchtitan Qwen3-MoE trained a few steps with
nothing left unattributed, and a planted culprit in it localized with ≤ 3 probes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradloc.collector.rules import rule_for
from tests import titan
from tests.helpers import single_thread, train_random_lm  # noqa: F401

needs_titan = pytest.mark.skipif(not titan.HAS_TITAN, reason="needs torchtitan (the test extra: scripts/setup.sh)")


class _Grouped(nn.Module):
    """The GroupedExperts layout (w1_EFD, w3_EFD, w2_EDF) computed token by token (the duck type, no kernels)."""

    def __init__(self, E: int, D: int, Fh: int) -> None:
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.randn(E, Fh, D, dtype=torch.float64) * 0.3)
        self.w3_EFD = nn.Parameter(torch.randn(E, Fh, D, dtype=torch.float64) * 0.3)
        self.w2_EDF = nn.Parameter(torch.randn(E, D, Fh, dtype=torch.float64) * 0.3)


class _Routed(nn.Module):
    """The parent that carries the routing (torchtitan's RoutedExperts' call signature)."""

    def __init__(self, E: int, D: int, Fh: int) -> None:
        super().__init__()
        self.inner_experts = _Grouped(E, D, Fh)

    def forward(self, x, scores, ids, counts):  # noqa: ANN001, ANN201
        ex = self.inner_experts
        B, L, D = x.shape
        out = torch.zeros_like(x).reshape(-1, D)  # (B, L, D) -> (T, D)
        xt, st, it = x.reshape(-1, D), scores.reshape(B * L, -1), ids.reshape(B * L, -1)
        for t in range(B * L):
            for k in range(it.shape[1]):
                e = int(it[t, k])
                h = F.silu(ex.w1_EFD[e] @ xt[t]) * (ex.w3_EFD[e] @ xt[t])
                out[t] = out[t] + st[t, k] * (ex.w2_EDF[e] @ h)
        return out.reshape(B, L, D)  # (T, D) -> (B, L, D)


def _brute(routed: nn.Module, x, scores, ids, counts, G) -> torch.Tensor:  # noqa: ANN001
    """(B·L,) ‖∇_experts of ⟨y_p, G_p⟩‖² per token, by autograd one token at a time."""
    params = [p for p in routed.inner_experts.parameters() if p.requires_grad]
    y = routed(x, scores, ids, counts)
    B, L = x.shape[:2]
    return torch.stack([sum(gr.double().pow(2).sum() for gr in torch.autograd.grad(
        (y[b, t] * G[b, t]).sum(), params, retain_graph=True)) for b in range(B) for t in range(L)])


def _routing(B: int, L: int, E: int, K: int, D: int, dtype=torch.float64, seed: int = 3):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, D, generator=g, dtype=dtype)
    ids = torch.rand(B, L, E, generator=g).argsort(-1)[..., :K].contiguous()  # (B, L, K) distinct experts per token
    scores = torch.softmax(torch.randn(B, L, K, generator=g), -1).to(dtype)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    return x, scores, ids, counts, torch.randn(B, L, D, generator=g, dtype=dtype)


def _rule_score(routed: nn.Module, args: tuple, G: torch.Tensor) -> torch.Tensor:
    ex = routed.inner_experts
    rule = rule_for(ex)
    assert type(rule).__name__ == "GroupedExpertsRule" and rule.site(ex, routed) is routed
    out = routed(*args)
    return rule.score(ex, rule.capture_call(ex, args, out), G).reshape(-1)  # (B, L) -> (T,)


def test_grouped_experts_scores_match_per_token_autograd():
    torch.manual_seed(0)
    routed = _Routed(E=4, D=6, Fh=5)
    x, scores, ids, counts, G = _routing(2, 3, 4, 2, 6)
    got = _rule_score(routed, (x, scores, ids, counts), G)
    torch.testing.assert_close(got.double(), _brute(routed, x, scores, ids, counts, G), rtol=1e-5, atol=1e-12)


def test_a_frozen_half_counts_only_the_trained_weights():
    """w3 frozen: its slice of ε is not in any gradient, so it is not in the score."""
    torch.manual_seed(1)
    routed = _Routed(E=3, D=4, Fh=3)
    routed.inner_experts.w3_EFD.requires_grad_(False)
    x, scores, ids, counts, G = _routing(1, 4, 3, 2, 4, seed=5)
    got = _rule_score(routed, (x, scores, ids, counts), G)
    torch.testing.assert_close(got.double(), _brute(routed, x, scores, ids, counts, G), rtol=1e-5, atol=1e-12)


def test_experts_without_a_routing_parent_are_unruled():
    """The experts module called on its own (no parent carrying the routing): no rule, said at watch()."""
    from gradloc.collector.layer_stats import module_layer_map
    from gradloc.collector.token_hooks import TokenHooks

    model = nn.Sequential(_Grouped(2, 3, 2))
    hooks = TokenHooks(model, module_layer_map(model, "module"))
    assert hooks.unruled == {"_Grouped"} and not hooks.watched


@needs_titan
def test_torchtitan_routed_experts_match_per_token_autograd():
    """torchtitan's own RoutedExperts (LocalTokenDispatcher, GroupedExperts on torch._grouped_mm in bf16):
    the rule recomputes in float32, so it matches the bf16 kernels' per-token gradients to bf16 precision."""
    torch.manual_seed(0)
    model = titan.qwen3_moe(experts=4, top_k=2, dim=32, hidden=16)
    routed = titan.routed_experts_of(model)
    with torch.no_grad():
        for p in routed.inner_experts.parameters():
            p.normal_(0, 0.3)
    x, scores, ids, counts, G = _routing(2, 5, 4, 2, 32, dtype=torch.float32)
    got = _rule_score(routed, (x, scores, ids, counts), G)
    brute = _brute(routed, x, scores, ids, counts, G)
    torch.testing.assert_close(got.double(), brute, rtol=3e-2, atol=1e-6)


def _train(model: nn.Module, steps: int, plant: tuple | None = None, probes: bool = False):  # noqa: ANN202
    return train_random_lm(model, titan.VOCAB, steps, plant, probes)


@needs_titan
@pytest.mark.filterwarnings("ignore")
def test_a_torchtitan_moe_model_is_fully_attributed():
    """Every parameter of torchtitan's Qwen3-MoE has a rule (grouped experts, router gate, norms, q/k norms,
    fused qkv, embedding, head); trained 3 steps on random tokens, nothing is unattributed."""
    model = titan.qwen3_moe()
    reports, covered = _train(model, 3)
    assert any(n.endswith("inner_experts") for n in covered)
    rec = reports[-1].record
    assert rec.tokens.dropped_calls == 0 and rec.tokens.unattributed_share == 0.0
    experts = [s for s in rec.layers if s.layer.endswith("inner_experts")]
    assert experts and all(s.grad_norm > 0 for s in experts)


@needs_titan
@pytest.mark.filterwarnings("ignore")
def test_a_planted_culprit_in_a_torchtitan_moe_model_is_localized():
    reports, _ = _train(titan.qwen3_moe(), steps=6, plant=(5, 1, 2, 7), probes=True)
    loc = reports[5].incident.localization
    assert loc.status == "located" and loc.probes <= 3, loc.note
    assert [(c.micro_batch, c.sample, c.position) for c in loc.culprits][:1] == [(1, 2, 7)]
    assert loc.explained_share > 0.5
