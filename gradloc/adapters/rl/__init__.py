"""RL with vLLM rollouts: the rollout join and the framework helpers (no hard dependency on any of them).

- :func:`join` turns vLLM ``RequestOutput`` objects into the training layout (padded or packed),
  with the engine's log-probs and the span metadata incidents carry.
- Per-token RL fields go to ``Monitor.rl_fields(...)`` inside each micro-batch block.
"""
from gradloc.adapters.rl.join import PackedRollouts, RolloutError, Rollouts, Skipped, join

__all__ = ["PackedRollouts", "RolloutError", "Rollouts", "Skipped", "join"]
