"""The data-parallel backends: how the ranks of a data group hold the gradient and combine a probe's.

- **ddp** (``DistributedDataParallel``): every rank holds the averaged gradient whole. Hooks go on
  ``model.module`` (the same parameters, no ``module.`` prefix); a probe runs the user's closure under
  ``no_sync()`` (its backward must not start the gradient all-reduce on one rank only) and without DDP's
  buffer broadcast (``_probing``), so no probe forward issues a collective and ranks without
  candidates idle, and ∇_C is summed over the group by one all-reduce per tensor and divided by dp, as
  DDP averages the training gradient. The decomposition probe runs on the rank that holds the
  micro-batch (the stored gradient is whole there). A model with ``SyncBatchNorm`` (collectives inside
  its own forward and backward, which no probe plan can pair across ranks) is watched without probes
  (``probe_hazard``: said at attach, shares unverified).
- **fsdp** (FSDP2 ``fully_shard``): parameters and gradients are DTensor shards; a probe's forward and
  backward are collectives (all-gather, reduce-scatter), so every rank takes part in every probe
  (lockstep) and the reduce-scatter already combined ∇_C (linear).
- **deepspeed** (a ``DeepSpeedEngine``, duck-typed: deepspeed is never imported here): hooks on
  ``engine.module``; the gradient read where each ZeRO stage keeps it (parallel/zero), probes by
  ``torch.autograd.grad`` (no ZeRO hook fires), lockstep under ZeRO-3; its own scope
  (``parallel/scope.py``: ``ZeroScope``). The engine always has a process group, so even one rank is a
  job of W = 1.
- **none**: one rank's own gradient (a data group of one rank: TP or PP alone).
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

import torch
from torch import nn

from gradloc.errors import ConfigError
from gradloc.localizer.probes import Grads
from gradloc.parallel.backend import DataBackend, register_backend


def is_deepspeed(model: object) -> bool:
    """A deepspeed.DeepSpeedEngine (duck-typed, so that deepspeed is imported only by its adapter)."""
    return all(hasattr(model, a) for a in ("module", "is_gradient_accumulation_boundary", "zero_optimization_stage",
                                           "gradient_accumulation_steps"))


@register_backend
class DDP(DataBackend):
    name, order, decomposes = "ddp", 20, True

    def __init__(self, wrapper: nn.Module) -> None:
        self.wrapper = wrapper
        inner = getattr(wrapper, "module", None)
        if inner is not None and any(isinstance(m, nn.SyncBatchNorm) for m in inner.modules()):
            self.probe_hazard = (
                "probes are off: SyncBatchNorm all-reduces batch statistics inside forward and backward, so a "
                "probe on one rank would wait for the others (shares are attribution scores)")

    @classmethod
    def detect(cls, model: nn.Module, world: Any) -> "DDP | None":
        from torch.nn.parallel import DistributedDataParallel

        return cls(model) if isinstance(model, DistributedDataParallel) else None

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if model is self.wrapper else model

    def probe_context(self) -> ContextManager[Any]:
        return _probing(self.wrapper)

    def combine(self, acc: Grads, data: Any, params: list[nn.Parameter]) -> Grads:
        full = [g if g is not None else torch.zeros_like(p) for g, p in zip(acc, params)]
        if data.world_size > 1:
            data.all_reduce_(full, "gradloc probe combine")  # Σ over ranks …
        torch._foreach_div_(full, float(data.world_size))  # … averaged, as DDP averages the training gradient
        return full

    def contribution(self, dp: int) -> float:
        return 1.0 / dp


@contextlib.contextmanager
def _probing(ddp: nn.Module) -> Iterator[None]:
    """DDP's forward without its collectives, for the probes: ``no_sync`` (a probe's backward must not start
    the gradient all-reduce on one rank only) and no buffer broadcast. With its default
    ``broadcast_buffers=True`` DDP broadcasts rank 0's buffers at the start of the first forward after a
    synchronised backward — a collective inside ``forward``: when the ranks' probe plans differ (the ranks
    without candidates idle) it pairs with another rank's next training forward, and every rank stalls.
    Skipping it is exact: the probe session restores every buffer afterwards, and the flag is put back, so
    the next training forward broadcasts exactly as it would have without gradloc."""
    sync = ddp.require_forward_param_sync
    with ddp.no_sync():
        ddp.require_forward_param_sync = False
        try:
            yield
        finally:
            ddp.require_forward_param_sync = sync


@register_backend
class FSDP(DataBackend):
    name, order, lockstep, linear, local_forward = "fsdp", 30, True, True, False

    @classmethod
    def detect(cls, model: nn.Module, world: Any) -> "FSDP | None":
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without FSDP2
            return None
        return cls() if any(isinstance(m, FSDPModule) for m in model.modules()) else None


@register_backend
class DeepSpeed(DataBackend):
    name, order = "deepspeed", 10
    local_forward = False  # ZeRO-3 gathers parameters inside forward
    measures_updates = False  # update ratios: not measured under DeepSpeed (docs/deepspeed.md)
    probes_alone = False  # alone after a failed collective, a probe would use .backward() (ZeRO's hooks fire)
    wraps_backward = True  # engine.backward divides the loss by gradient_accumulation_steps
    own_partitions = True  # ZeRO reads and combines its own partitions (parallel/zero)

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @classmethod
    def detect(cls, model: nn.Module, world: Any) -> "DeepSpeed | None":
        return cls(model) if is_deepspeed(model) else None

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.engine.module if model is self.engine else model

    def layer_stats(self, job: Any) -> Any:
        """Read from ZeRO's buffers (parallel/zero): p.grad is gone by the time the step is read."""
        if job.config.remedy is not None:
            raise ConfigError(f"remedy={job.config.remedy!r} is not supported under DeepSpeed (the gradient lives in "
                              "ZeRO's buffers); leave remedy=None")
        from gradloc.parallel.zero.stats import DeepSpeedLayerStats

        return DeepSpeedLayerStats(self.engine, job.config.layer_grouping, job.world)

    def step_problem(self, layer_stats: Any) -> str:
        if layer_stats.at_boundary():
            return ""
        return ("end_step must be called after engine.backward() of the step's last micro-batch and before "
                "engine.step(): DeepSpeed holds the reduced gradient only there")

    def scope(self, job: Any, layer_stats: Any, **args: Any) -> Any:
        from gradloc.parallel.scope import ZeroScope

        return ZeroScope(deepspeed=layer_stats, job=job, **args)


@register_backend
class Alone(DataBackend):
    """A data group of one rank (TP or PP without data parallelism): this rank's gradient is the group's."""

    name, order, linear, decomposes = "none", 90, True, True

    @classmethod
    def detect(cls, model: nn.Module, world: Any) -> None:
        return None  # never detected: the job falls back to it


__all__ = ["DDP", "FSDP", "DeepSpeed", "Alone", "is_deepspeed"]
