"""Per-token rules; importing this package registers every built-in rule."""
from gradloc.collector.rules import (  # noqa: F401  (registers)
    conv1d,
    embedding,
    experts,
    grouped_experts,
    layer_norm,
    linear,
    megatron,
    megatron_embedding,
    rms_norm,
    router,
    sinks,
)
from gradloc.collector.rules.registry import (
    TokenRule,
    register_duck_rule,
    register_rule,
    rule_for,
)

__all__ = ["TokenRule", "register_rule", "register_duck_rule", "rule_for"]
