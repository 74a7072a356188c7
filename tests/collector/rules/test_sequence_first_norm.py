"""A torch norm that a Megatron module calls on ``[s, b, h]`` (rules/megatron.SequenceFirstNorm) vs the brute-force
reference: its scores, read batch-first (b, s), are each position's Σ ‖∇θ_p‖² (tests/collector/rules/reference.py);
a norm another module calls, and a Megatron module's other children (its embeddings: batch-first), keep their
rule as it is. No megatron import: the caller is a module whose class says it is Megatron's (the duck typing's
test)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gradloc.collector.rules import rule_for
from gradloc.collector.rules.megatron import SequenceFirstNorm, sequence_first_view
from tests.collector.rules.reference import LlamaRMSNorm, per_position_reference

TransformerLayer = type("TransformerLayer", (nn.Module,), {"__module__": "megatron.core.transformer.transformer_layer"})


@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(8), lambda: nn.RMSNorm(8), lambda: LlamaRMSNorm(8)],
                         ids=["layer_norm", "rms_norm", "hf_rms_norm"])
def test_a_norm_megatron_calls_sequence_first_is_scored_per_position_batch_first(make) -> None:
    torch.manual_seed(0)
    norm = make()
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # not the identity's parameters
    rule = sequence_first_view(rule_for(norm), TransformerLayer())
    assert isinstance(rule, SequenceFirstNorm)
    S, B = 5, 3  # [s, b, h]; B != S: a transposed read would not fit
    x, g = torch.randn(S, B, 8), torch.randn(S, B, 8)
    y = norm(x)
    assert rule.lead_shape(norm, x, y) == (B, S)
    with torch.no_grad():
        got = rule.score(norm, rule.capture(norm, x, y), g)  # (b, s)
    want = per_position_reference(norm, x, g, 1).t()  # [s, b] -> (b, s)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-9)
    # q/k layernorm: [s, b, heads, d], the heads sharing the norm's parameters — position (b, s)'s gradient is the
    # sum over its heads' (the reference treats (heads, d) as the features of one call)
    xh, gh = torch.randn(S, B, 3, 8), torch.randn(S, B, 3, 8)
    yh = norm(xh)
    assert rule.lead_shape(norm, xh, yh) == (B, S, 3)
    with torch.no_grad():
        got = rule.score_grouped(norm, rule.capture(norm, xh, yh), gh, 1)  # (b, s)
    want = per_position_reference(norm, xh, gh, 2).t()  # [s, b] -> (b, s)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-9)
    # the caller's heads split over 2 tp ranks: a rank's part of a position's gradient is not its whole (Megatron
    # sums the q/k layernorm's gradient over tp), so the per-head call is not placed; [s, b, h] calls still are
    split = TransformerLayer()
    split.config = SimpleNamespace(tensor_model_parallel_size=2)
    on_tp = sequence_first_view(rule_for(norm), split)
    assert on_tp.lead_shape(norm, xh, yh) == () and on_tp.lead_shape(norm, x, y) == (B, S)


def test_other_callers_and_other_rules_are_left_as_they_are() -> None:
    norm, emb = nn.LayerNorm(8), nn.Embedding(10, 8)
    assert sequence_first_view(rule_for(norm), nn.Sequential()) is rule_for(norm)  # a torch caller
    assert sequence_first_view(rule_for(norm), None) is rule_for(norm)  # the model itself
    assert sequence_first_view(rule_for(emb), TransformerLayer()) is rule_for(emb)  # Megatron's embeddings: (b, s)
    assert sequence_first_view(None, TransformerLayer()) is None
