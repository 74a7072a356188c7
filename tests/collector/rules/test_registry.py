"""Which modules get which per-token rule; registration errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradloc
from gradloc.collector.rules import registry, rule_for
from gradloc.collector.rules.embedding import EmbeddingRule
from gradloc.collector.rules.layer_norm import LayerNormRule
from gradloc.collector.rules.linear import LinearRule
from gradloc.collector.rules.rms_norm import HFRMSNormRule, TorchRMSNormRule
from tests.collector.rules.reference import LlamaRMSNorm


@pytest.fixture
def isolated_registry(monkeypatch):
    """Registrations made by a test do not leak into the global registry."""
    monkeypatch.setattr(registry, "_BY_TYPE", dict(registry._BY_TYPE))
    monkeypatch.setattr(registry, "_BY_PREDICATE", list(registry._BY_PREDICATE))


class KeepsForward(nn.Linear):
    pass


class KeepsForwardTwoLevels(KeepsForward):
    pass


class OverridesForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class InheritsOverriddenForward(OverridesForward):
    pass



class Qwen2RMSNorm(LlamaRMSNorm):
    pass


class T5LikeRMSNorm(nn.Module):  # uses `eps`, not `variance_epsilon`
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6


class ScaleNorm(nn.Module):  # right attributes, wrong name
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = 1e-6


class Matrix2DRMSNorm(nn.Module):  # right name, 2-D weight
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, d))
        self.variance_epsilon = 1e-6


class NoEpsRMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class BufferWeightRMSNorm(nn.Module):  # weight is a buffer, not a parameter
    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(d))
        self.eps = 1e-6


class CustomRMSNorm(nn.RMSNorm):  # subclass of torch's, own forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1


class PlainRMSNormSubclass(nn.RMSNorm):
    pass


def test_builtin_types():
    assert isinstance(rule_for(nn.Linear(2, 3)), LinearRule)
    assert isinstance(rule_for(nn.Embedding(4, 2)), EmbeddingRule)
    assert isinstance(rule_for(nn.LayerNorm(3)), LayerNormRule)
    assert isinstance(rule_for(nn.RMSNorm(3)), TorchRMSNormRule)
    for unsupported in (nn.Conv1d(2, 2, 1), nn.GELU(), nn.Sequential(nn.Linear(2, 2)), nn.MultiheadAttention(4, 2)):
        assert rule_for(unsupported) is None, type(unsupported).__name__


def test_one_rule_instance_serves_every_module_of_a_type():
    assert rule_for(nn.Linear(2, 3)) is rule_for(nn.Linear(5, 1, bias=False))


def test_subclass_keeping_forward_gets_the_base_rule():
    base = rule_for(nn.Linear(2, 2))
    assert rule_for(KeepsForward(2, 2)) is base
    assert rule_for(KeepsForwardTwoLevels(2, 2)) is base
    assert rule_for(PlainRMSNormSubclass(4)) is rule_for(nn.RMSNorm(4))


def test_subclass_overriding_forward_gets_no_rule():
    assert rule_for(OverridesForward(2, 2)) is None
    assert rule_for(InheritsOverriddenForward(2, 2)) is None  # inherits the overridden forward
    assert rule_for(CustomRMSNorm(4)) is None  # and is not mistaken for an HF-style RMSNorm either


def test_hf_rms_norm_detected_by_shape():
    assert isinstance(rule_for(LlamaRMSNorm(8)), HFRMSNormRule)
    assert isinstance(rule_for(Qwen2RMSNorm(8)), HFRMSNormRule)
    assert isinstance(rule_for(T5LikeRMSNorm(8)), HFRMSNormRule)


@pytest.mark.parametrize("cls", [ScaleNorm, Matrix2DRMSNorm, NoEpsRMSNorm, BufferWeightRMSNorm])
def test_lookalikes_not_detected(cls):
    assert rule_for(cls(4)) is None


def test_registering_a_duplicate_type_raises():
    class DummyRule:
        pass

    before = rule_for(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already registered"):
        registry.register_rule(nn.Linear)(DummyRule)
    assert rule_for(nn.Linear(2, 2)) is before  # the existing rule is untouched


def test_failed_multi_type_registration_registers_nothing(isolated_registry):
    class Fresh(nn.Module):
        pass

    class DummyRule:
        pass

    with pytest.raises(ValueError, match="Linear"):
        registry.register_rule(Fresh, nn.Linear)(DummyRule)
    assert rule_for(Fresh()) is None  # no half-done registration
    registry.register_rule(Fresh)(DummyRule)  # so retrying without the duplicate works
    assert isinstance(rule_for(Fresh()), DummyRule)


def test_public_register_rule_and_duck_rule(isolated_registry):
    class MyMixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

    class Shaped(nn.Module):
        marker = True

    @gradloc.register_rule(MyMixer)
    class MixerRule:
        pass

    @gradloc.register_duck_rule(lambda m: getattr(m, "marker", False))
    class DuckRule:
        pass

    assert isinstance(rule_for(MyMixer()), MixerRule)
    assert isinstance(rule_for(Shaped()), DuckRule)
    assert rule_for(nn.GELU()) is None


def test_type_rule_wins_over_duck_rule(isolated_registry):
    class FancyRMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))
            self.eps = 1e-6

    @registry.register_rule(FancyRMSNorm)
    class FancyRule:
        pass

    assert isinstance(rule_for(FancyRMSNorm()), FancyRule)
