"""One backend per parallelism, registered by name, detected from the model (as rules are by module type).

A job is one **data** backend — how the ranks of a data group (the localizer's ranks) hold the
gradient and combine a probe's: ``ddp``, ``fsdp`` (FSDP2), ``deepspeed`` (ZeRO 0–3), or ``none`` — plus
any **model** backends, each owning one model dimension: ``tp`` (DTensor tensor/sequence parallel,
also under FSDP2: 2D), ``megatron`` (Megatron-core's parallel linears), ``pp``
(torch.distributed.pipelining), ``ep`` (experts sharded over an expert group). What each owns:

- ``unwrap``: the module its hooks and statistics watch (DDP's inner module, a stage's submodule);
- ``coords``: this rank's coordinate along its model dim (``parallel/layout.py`` builds the groups);
- ``slice_key``: which slice of a parameter this rank holds (``parallel/placement.py`` turns the keys of
  every rank into replica weights: exact global norms, no double counting);
- the probe runner: data backends say whether probes are lockstep across the data group, run in a
  context (DDP: ``no_sync``), and how a probe's gradient combines over the group (``combine``); the
  pipeline backend runs probes through the schedule on every stage;
- how per-token scores combine: model backends adapt what a hook sees (DTensor shards, Megatron's
  [s, b, h], sequence shards) and the token group sums the scores once per step.

``detect`` tries every registered backend on the model; at most one data backend may claim it.
"""
from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager

from torch import nn

from gradloc.localizer.probes import Grads
from gradloc.parallel.placement import SliceKey, dtensor_slice

_BACKENDS: dict[str, type["Backend"]] = {}


def register_backend(cls: type["Backend"]) -> type["Backend"]:
    """Class decorator: a backend class with a unique ``name``."""
    if cls.name in _BACKENDS:
        raise ValueError(f"a parallel backend named {cls.name!r} is already registered")
    _BACKENDS[cls.name] = cls
    return cls


def backends() -> dict[str, type["Backend"]]:
    return dict(_BACKENDS)


class Backend:
    name: ClassVar[str]
    role: ClassVar[str]  # "data" | "model"
    order: ClassVar[int] = 50  # unwrapping order: outer wrappers first (pipeline stage, DDP) …

    @classmethod
    def detect(cls, model: nn.Module, world: Any) -> "Backend | None":
        """An instance when this parallelism is present on ``model`` (``world``: the job's JobComm or None)."""
        raise NotImplementedError

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def coords(self) -> dict[str, tuple[int, int]]:
        """This rank's (coordinate, size) along the model dims this backend owns."""
        return {}

    def slice_key(self, name: str, param: nn.Parameter) -> SliceKey | None:
        """This rank's slice of ``param``; None: not this backend's to say."""
        return None

    def configure_hooks(self, hooks: Any, layout: Any) -> None:
        """Adapt the token hooks to what they see under this parallelism (before they attach)."""

    def combine_probe(self, acc: Any, params: list[nn.Parameter], layout: Any) -> Any:
        """A probe's gradient as the training step's would be when it is read (Megatron SP: the ``sequence_parallel``
        parameters' gradients summed over tp, as ``finalize_model_grads`` sums the step's); as it is by default."""
        return acc


class DataBackend(Backend):
    role = "data"
    lockstep: bool = False  # every rank of the data group takes part in every probe (its forward is a collective)
    linear: bool = False  # a probe's gradient is the group's already (nothing to combine): probes accumulate
    decomposes: bool = False  # the stored gradient is whole on the rank that holds a micro-batch
    probe_hazard: str = ""  # why probes cannot run in this job (the model's own collectives): localizations unverified
    local_forward: bool = True  # a forward is this rank's own (no collective in it): a step's forward can be re-run
    measures_updates: bool = True  # the optimizer steps the watched parameters: update ratios are measured
    probes_alone: bool = True  # after a failed collective, this rank alone can still run a probe
    wraps_backward: bool = False  # the wrapper's own backward scales the loss (1/accumulation); probes call the module
    own_partitions: bool = False  # reads and combines its own gradient partitions: no replica weights, no relayout

    def probe_context(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def layer_stats(self, job: Any) -> Any:
        """This rank's per-layer statistics collector: read from the parameters' ``.grad`` by default."""
        from gradloc.collector.layer_stats import LayerStatsCollector

        return LayerStatsCollector(job.model, job.config.layer_grouping)

    def step_problem(self, layer_stats: Any) -> str:
        """Why this step's gradient cannot be read where ``end_step`` was called ('' when it can)."""
        return ""

    def scope(self, job: Any, layer_stats: Any, **args: Any) -> Any:
        """The one scope through which a spike step's probes run and combine (parallel/scope.py)."""
        from gradloc.parallel.scope import JobScope

        return JobScope(view=job.grad_view, loss_weight=job.loss_weight, job=job, **args)

    def combine(self, acc: Grads, data: Any, params: list[nn.Parameter]) -> Grads:
        """The data group's ∇_C from this rank's probe gradient ``acc`` (DDP: summed and averaged)."""
        return acc

    def contribution(self, dp: int) -> float:
        """The factor a rank's own probe gradient (and loss) enters the group's with (DDP: 1/dp)."""
        return 1.0


class ModelBackend(Backend):
    role = "model"
    dim: ClassVar[str]

    def run_step(self, mon: Any, schedule: Any, **kw: Any) -> Any:
        """One training step driven through the monitor by this backend (the pipeline's schedule step); None:
        this backend drives no step (the user's loop does)."""
        return None

    def take_probe(self) -> Any:
        """The probe closure of the step this backend drove (``run_step``), once; None when it drove none."""
        return None


def default_slice_key(name: str, param: nn.Parameter, stage: int = 0) -> SliceKey:
    shape, offset, local_shape = dtensor_slice(param)
    return (f"{stage}:{name}" if stage else name, shape, offset, local_shape)


__all__ = ["Backend", "DataBackend", "ModelBackend", "backends", "default_slice_key", "register_backend"]
