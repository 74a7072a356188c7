"""Watching one rank of a job: which backends, which groups, which layers, which weights.

:func:`resolve` walks the model from the outside in — a pipeline stage, a DeepSpeed engine, DDP,
FSDP2, DTensor tensor parallelism, Megatron's parallel layers, expert parallelism — letting each
registered backend (``parallel/backend.py``) claim and unwrap it. The result is a :class:`Job`: the
module the hooks watch, one data backend, the model backends, and (for a multi-rank job) the world
communicator. A plain model in a multi-rank job (no wrapper, no DTensor) is watched rank by rank, as
separate processes of one job, with no collective.

:meth:`Job.setup` runs once, when the monitor is built, on every rank together: it builds the layout
(``parallel/layout.py``) and makes **one** gather of what every rank watches — its layer names and
sizes, its token layers, its settings and the slice of every parameter it holds — from which every
rank derives the same global layer list (under PP: the stages' layers in stage order), checks that
the ranks of each data group watch the same layers with the same settings (a mismatch raises the same
:class:`AttachError` on every rank), and the replica weight of each parameter (``placement.py``).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, ContextManager

import torch
from torch import nn

import gradloc.parallel.data  # noqa: F401  (registers the data backends)
from gradloc.collector.shards import is_dtensor
from gradloc.config import WatchConfig
from gradloc.errors import AttachError, ConfigError, UnsupportedModelError
from gradloc.parallel.backend import Backend, DataBackend, ModelBackend, backends, default_slice_key
from gradloc.parallel.comm import JobComm
from gradloc.parallel.data import Alone, DeepSpeed
from gradloc.parallel.global_layers import GlobalLayers, check_ranks, global_layers
from gradloc.parallel.layout import Layout
from gradloc.parallel.placement import GradView, replica_weights

_LOADED = False


def _load_backends() -> None:
    """Every module of ``parallel/`` (imported here, at the first ``resolve``: the model backends import the
    collector, which must not import them), so that each registered backend is known: a new backend is one new
    module, named nowhere else."""
    global _LOADED
    if not _LOADED:
        import gradloc.parallel

        for m in pkgutil.iter_modules(gradloc.parallel.__path__):
            if not m.ispkg:
                importlib.import_module(f"gradloc.parallel.{m.name}")
        _LOADED = True


@dataclass
class Job:
    model: nn.Module  # what hooks and statistics watch (DDP's inner module, a stage's submodule …)
    outer: nn.Module  # what the user passed (uncompiled)
    config: WatchConfig  # with the job's rank and world size
    world: JobComm | None  # None: one process, or ranks watched independently
    data: DataBackend
    parts: tuple[ModelBackend, ...] = ()
    layout: Layout | None = None  # set by setup()
    weights: list[float] | None = None  # per watched parameter (setup); None: every rank's own
    layers: GlobalLayers | None = None
    grad_view: GradView | None = None  # DTensor gradients: local values and placement factors (attach_collectors)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """"single" (one rank, or ranks watched independently), else the data backend's name: for reports and
        tests; nothing outside parallel/ branches on it (tests/test_architecture.py)."""
        return "single" if self.world is None else self.data.name

    def describe(self) -> str:
        """The job's parallelism in words, for messages: "one rank", the data backend's name, or the model backends'."""
        if self.world is None:
            return "one rank"
        return " × ".join(b.name for b in self.parts) if self.parts else self.data.name

    @property
    def local_forward(self) -> bool:
        """A forward of this rank is its own (no collective in it): a flagged step's forward can be re-run alone."""
        return self.world is None or (self.data.local_forward and not self.parts)

    def scope(self, layer_stats: Any, *, alone: bool, params: list[nn.Parameter], metas: Any, probe: Any,
              pause_hooks: Callable[[bool], None], grads: list[Any], inv_scale: float, norm: float) -> Any:
        """The one scope through which a flagged step's probes (and its on_spike re-run) run and combine: over the
        job (parallel/scope.py), or — one process, or a rank that left its job — this rank's own
        (``localizer/scope.SoloScope``; None without a probe closure). ``grads``, ``inv_scale``, ``norm``: the
        stored gradient the probes are measured against."""
        if not alone:
            return self.data.scope(self, layer_stats, params=params, metas=metas, probe=probe,
                                   pause_hooks=pause_hooks, grads=grads, inv_scale=inv_scale, norm=norm)
        from gradloc.localizer.scope import solo_scope
        from gradloc.parallel.scope import opener

        opens = opener(self, params, metas, probe, pause_hooks) if probe is not None else None
        return solo_scope(opens, grads, inv_scale, norm)

    def step_problem(self, layer_stats: Any) -> str:
        """Why this step's gradient cannot be read where ``end_step`` was called ('' when it can)."""
        return self.data.step_problem(layer_stats)

    @property
    def probe_context(self) -> Callable[[], ContextManager[Any]]:
        return self.data.probe_context

    @property
    def lockstep(self) -> bool:
        """Every rank of a data group takes part in every probe (its forward or backward is a collective)."""
        return self.data.lockstep or any(getattr(b, "lockstep", False) for b in self.parts)

    @property
    def loss_weight(self) -> float:
        """What this rank's loss counts in a sum over the world that counts each data index once: 1/tp on the
        stage that computes the loss (the last; every rank without PP), 0 on the others."""
        if self.layout is None:
            return 1.0
        last = self.layout.coord.get("pp", 0) == self.layout.size("pp") - 1
        return 1.0 / self.layout.size("tp") if last else 0.0

    @property
    def holds_head(self) -> bool:
        """This rank reads the loss head's output gradient at the labels (collector/surprise.py): the last pipeline
        stage's ranks, under TP each its vocabulary shard's part (the token group sums them)."""
        return self.layout is None or self.layout.coord.get("pp", 0) == self.layout.size("pp") - 1

    @property
    def judges_samples(self) -> bool:
        """This rank judges its samples' surprise: it holds the head, and is the first of its tp group (every tp
        rank holds the summed u_p after the token group's exchange; one judges them), once per data index."""
        return self.holds_head and (self.layout is None or self.layout.coord.get("tp", 0) == 0)

    @property
    def summed(self) -> bool:
        """The per-layer pack is this rank's weighted share, summed over the world each step (otherwise every
        rank's pack is the job's already: DDP's replicas, ZeRO's combined partitions)."""
        return self.weights is not None

    def setup(self, params: list[tuple[str, nn.Parameter]], layers: list[str], numel: list[int],
              token_layers: list[str]) -> None:
        """Layout, global layers and replica weights (one gather; every rank together, at attach)."""
        if self.world is None:
            self.layers = GlobalLayers(tuple(layers), tuple(numel), tuple(range(len(layers))), tuple(token_layers),
                                       tuple(range(len(token_layers))))
            return
        from gradloc.parallel.unsupported import context_parallel

        cp = context_parallel(params)
        if cp:
            raise UnsupportedModelError(f"gradloc: {cp}: context parallelism is not supported (every rank holds a "
                                        "shard of each sequence, and per-token scores, samples and probes would read "
                                        "the shard as the whole row)")
        unclaimed = self.unclaimed_dims(params)
        if unclaimed:
            raise AttachError(f"gradloc: {unclaimed}; no parallel backend claims it, so its per-token scores and "
                              "statistics cannot be combined right (tp, ep and FSDP2's data dims are known; context "
                              "parallelism is not supported)")
        coords = {k: v for b in self.parts for k, v in b.coords().items()}
        self.layout = Layout.build(self.world, coords) if coords else Layout.flat(self.world)
        if isinstance(self.data, Alone) and self.layout.dp > 1:
            raise AttachError(f"gradloc: {self.layout.dp} data-parallel groups but no data-parallel wrapper (DDP, "
                              "FSDP2, DeepSpeed): their gradients are never combined, so they are not one job")
        stage = self.layout.coord.get("pp", 0)
        keys = None
        if not self.data.own_partitions:
            keys = [next((k for b in self.parts if (k := b.slice_key(n, p)) is not None), None)
                    or default_slice_key(n, p, stage) for n, p in params]
        settings = {f.name: repr(getattr(self.config, f.name)) for f in fields(self.config)
                    if f.repr and f.name not in ("rank", "store_path", "metrics_address")}  # no secrets travel
        mine = (tuple(self.layout.coord.items()), tuple(layers), tuple(numel), tuple(token_layers), settings,
                keys)
        every = self.world.all_gather_object(mine, "gradloc attach check")
        check_ranks(every, self.layout)
        self.layers = global_layers(every, self.world.rank)
        if keys is not None:
            w = replica_weights(keys, self.world)
            self.weights = None if all(x == 1.0 / self.world.world_size for x in w) and not self.parts else w


    def unclaimed_dims(self, params: list[tuple[str, nn.Parameter]]) -> str:
        """The first parameter split along a mesh dim no backend of this job claims ('' when none is): ``tp``
        needs the TP backend, ``ep`` the EP one, any other name (and an unnamed 1-D mesh) FSDP2's."""
        from gradloc.parallel.data import FSDP

        claimed = {b.dim for b in self.parts}
        fsdp = isinstance(self.data, FSDP)
        for name, p in params:
            placements = getattr(p, "placements", None)  # duck-read: the unit tests pass mesh metadata alone
            if not placements:
                continue
            dims = getattr(p.device_mesh, "mesh_dim_names", None)
            for i, pl in enumerate(placements):
                if pl.is_replicate():
                    continue
                dim = dims[i] if dims else None
                ok = dim in claimed if dim in ("tp", "ep") else fsdp and dim not in ("pp", "cp") and \
                    (dim is not None or p.device_mesh.ndim == 1)
                if not ok:
                    return f"parameter {name!r} is {pl} along mesh dim {dim or i!r} ({dims or 'unnamed'})"
        return ""

    # -- the collectors' side --------------------------------------------------------------------
    def layer_stats(self) -> Any:
        """This rank's per-layer statistics collector (the data backend's: DeepSpeed reads ZeRO's buffers)."""
        return self.data.layer_stats(self)

    def attach_collectors(self, layer_stats: Any, hooks: Any) -> None:
        """:meth:`setup` from the collectors' local view, then point them at the job's layers and weights."""
        self.setup(list(zip(layer_stats.names, layer_stats.params)), layer_stats.local_layers, layer_stats.local_numel,
                   list(hooks.layers) if hooks is not None else [])
        if self.world is None or self.data.own_partitions:
            return
        g = self.layers
        if any(is_dtensor(p) for p in layer_stats.params):  # DTensor parameters: gradients may differ
            self.grad_view = GradView(self.comm_for)
        layer_stats.relayout(g.names, g.numel, g.index, self.weights, self.grad_view)
        if hooks is not None:
            hooks.relayer(list(g.token_names), list(g.token_index))
            for b in self.parts:
                b.configure_hooks(hooks, self.layout)

    def run_step(self, mon: Any, schedule: Any, **kw: Any) -> Any:
        """A step driven by a model backend (the pipeline's schedule step); ConfigError when none drives steps."""
        for b in self.parts:
            out = b.run_step(mon, schedule, **kw)
            if out is not None:
                return out
        raise ConfigError("pipeline_step needs a monitor watching a pipeline stage: gradloc.watch(stage)")

    def take_probe(self) -> Any:
        """The probe closure of the step a model backend drove (once), else None."""
        return next((p for b in self.parts if (p := b.take_probe()) is not None), None)

    def combine_tokens(self, scores: Any, n_layers: int) -> Any:
        """The step's per-token scores summed over the token group (the ranks that split one sample's
        computation: tp, pp; parallel/tokens.py), once per step."""
        from gradloc.parallel.tokens import combine

        return combine(scores, self.layout.token, n_layers, self.config.layer_breakdown, self.holds_head,
                       self.layout.size("tp"))

    def comm_for(self, mesh: Any, dim: int) -> JobComm:
        """The deadline-guarded communicator of one DeviceMesh dim's group (cached)."""
        key = (id(mesh), dim)
        got = self.extra.setdefault("mesh_comms", {}).get(key)
        if got is None:
            names = getattr(mesh, "mesh_dim_names", None)
            got = self.extra["mesh_comms"][key] = self.world.sub(mesh.get_group(dim),
                                                                 names[dim] if names else f"mesh dim {dim}")
        return got



def resolve(model: nn.Module, cfg: WatchConfig) -> Job:
    _load_backends()
    world = JobComm.detect(cfg.collective_timeout_s) if cfg.distributed == "auto" else None
    outer = model = uncompiled(model)
    found: list[Backend] = []
    for cls in sorted(backends().values(), key=lambda c: c.order):
        got = cls.detect(model, world)
        if got is not None:
            found.append(got)
            model = uncompiled(got.unwrap(model))
    data = [b for b in found if isinstance(b, DataBackend)]
    if len(data) > 1:
        raise UnsupportedModelError(f"gradloc: {' and '.join(b.name for b in data)} both wrap this model; one "
                                    "data-parallel wrapper is supported")
    parts = tuple(b for b in found if isinstance(b, ModelBackend))
    if isinstance(data[0] if data else None, DeepSpeed):
        world = world or _one_rank_job(cfg.collective_timeout_s)
        if parts:
            raise UnsupportedModelError("gradloc: a DeepSpeed engine combined with "
                                        f"{', '.join(b.name for b in parts)}: not supported (ZeRO data parallelism only)")
    if world is None or (not data and not parts):  # one process, or ranks watched independently
        if world is not None and cfg.world_size == 1 and cfg.rank == 0:
            cfg = replace(cfg, rank=world.rank, world_size=world.world_size)  # each rank's records name it
        return Job(model, outer, cfg, None, data[0] if data else Alone())
    if cfg.world_size not in (1, world.world_size) or (cfg.world_size == world.world_size and cfg.rank != world.rank):
        raise ConfigError(f"WatchConfig says rank {cfg.rank} of {cfg.world_size}, but this process is rank "
                          f"{world.rank} of {world.world_size} in the process group: leave rank/world_size unset")
    cfg = replace(cfg, rank=world.rank, world_size=world.world_size)
    return Job(model, outer, cfg, world, data[0] if data else Alone(), parts)


def _one_rank_job(timeout_s: float) -> JobComm:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UnsupportedModelError("a DeepSpeed engine without an initialized process group: create it with "
                                    "deepspeed.initialize (which calls deepspeed.init_distributed)")
    return JobComm(dist.get_rank(), dist.get_world_size(), timeout_s)


def check_model(model: nn.Module) -> nn.Module:
    if not isinstance(model, nn.Module) and not hasattr(model, "submod"):
        raise UnsupportedModelError(f"gradloc.watch expects a torch.nn.Module, got {type(model).__name__}")
    inner = getattr(model, "submod", model)  # a pipeline stage: its submodule's parameters
    if not any(p.requires_grad for p in inner.parameters()):
        raise UnsupportedModelError("the model has no trainable parameters")
    return uncompiled(model) if isinstance(model, nn.Module) else model


def uncompiled(model: Any) -> Any:
    """The module under a ``torch.compile(model)`` wrapper (the same parameters, hooks and names, no
    "_orig_mod." prefix); anything else as it is. Hooks registered on it before the wrapper's first
    call are traced into the graph (collector/compiled.py)."""
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


__all__ = ["GlobalLayers", "Job", "check_model", "resolve", "uncompiled"]
