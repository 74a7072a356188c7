"""Watching one rank of a multi-rank job: unwrap the model, join the job, check every rank agrees.

- **DDP**: the hooks and statistics go on ``model.module`` (the same parameters, without the
  ``module.`` prefix in layer names); probes run the user's closure under ``model.no_sync()`` so their
  backward never starts the gradient all-reduce on one rank only.
- **FSDP2** (``fully_shard``): the model is watched as it is; its parameters and gradients are
  DTensor shards (``LayerStatsCollector.sharded``), and every rank takes part in every probe.
- **DeepSpeed** (a ``DeepSpeedEngine``, duck-typed: deepspeed is never imported here): hooks on
  ``engine.module``; the gradient is read where each ZeRO stage keeps it (adapters/deepspeed). The
  engine always has a process group (``deepspeed.initialize`` makes one), so even one rank is a job
  of W = 1 and takes the job's spike path, whose probes DeepSpeed allows.
- A plain model in a multi-rank job (no DDP/FSDP2 wrapper) is watched rank by rank, as before: its
  gradients are each rank's own, so no collective runs and the agent correlates the ranks.
- The rank and world size come from the process group. A configuration that says otherwise is a
  setup error, and so is any rank watching different layers or with different settings: every rank
  exchanges a fingerprint at attach, and every rank raises the same :class:`AttachError` on a
  mismatch (instead of some ranks entering collectives the others never reach).
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from gradloc.adapters.dist import JobComm
from gradloc.collector.job import JobView
from gradloc.collector.layer_stats import LayerStatsCollector
from gradloc.config import WatchConfig
from gradloc.errors import AttachError, ConfigError, UnsupportedModelError
from gradloc.records import StepRecord


@dataclass(frozen=True)
class JobSetup:
    model: nn.Module  # what hooks and statistics watch (DDP's inner module)
    config: WatchConfig  # with the job's rank and world size
    comm: JobComm | None
    probe_context: Callable[[], ContextManager[Any]]  # wraps each probe (DDP: no_sync)
    kind: str  # "single" (one rank, or ranks watched independently) | "ddp" | "fsdp" | "deepspeed"


def resolve(model: nn.Module, cfg: WatchConfig) -> JobSetup:
    comm = JobComm.detect(cfg.collective_timeout_s) if cfg.distributed == "auto" else None
    model = uncompiled(model)
    inner, ctx, kind = model, contextlib.nullcontext, "single"
    if is_deepspeed(model):
        inner, kind = model.module, "deepspeed"
        comm = comm or _one_rank_job(cfg.collective_timeout_s)
    elif _is_ddp(model):
        inner, ctx, kind = model.module, model.no_sync, "ddp"
    elif comm is not None and _is_fsdp2(model):
        kind = "fsdp"
    if comm is None:
        return JobSetup(inner, cfg, None, ctx, kind)
    if cfg.world_size not in (1, comm.world_size) or (cfg.world_size == comm.world_size and cfg.rank != comm.rank):
        raise ConfigError(f"WatchConfig says rank {cfg.rank} of {cfg.world_size}, but this process is rank "
                          f"{comm.rank} of {comm.world_size} in the process group: leave rank/world_size unset")
    cfg = replace(cfg, rank=comm.rank, world_size=comm.world_size)
    # A plain model in a multi-rank job has each rank's own gradients (no wrapper reduces them here):
    # its ranks are watched independently, as separate processes of one job, with no collective.
    return JobSetup(inner, cfg, comm if kind != "single" else None, ctx, kind)


def check_consistent(comm: JobComm, cfg: WatchConfig, layers: list[str], token_layers: list[str]) -> None:
    """Every rank must watch the same layers with the same settings (one collective, at attach)."""
    settings = {f.name: repr(getattr(cfg, f.name)) for f in fields(cfg)
                if f.repr and f.name not in ("rank", "store_path", "metrics_address")}  # no secrets travel
    mine = hashlib.sha256(repr((layers, token_layers, sorted(settings.items()))).encode()).hexdigest()
    every = comm.all_gather_object((mine, len(layers), len(token_layers), settings), "gradloc attach check")
    bad = [r for r, (h, *_) in enumerate(every) if h != every[0][0]]
    if bad:
        diff = sorted(k for k in settings if any(e[3].get(k) != every[0][3].get(k) for e in every))
        what = f"settings differ: {diff}" if diff else "the watched layers differ: " + \
            ", ".join(f"rank {r}: {e[1]} layers / {e[2]} token layers" for r, e in enumerate(every))
        raise AttachError(f"gradloc: ranks {bad} do not match rank 0 ({what}); every rank must watch the same "
                          "model with the same WatchConfig")


def is_deepspeed(model: object) -> bool:
    """A deepspeed.DeepSpeedEngine (duck-typed, so that deepspeed is imported only by its adapter)."""
    return all(hasattr(model, a) for a in ("module", "is_gradient_accumulation_boundary", "zero_optimization_stage",
                                           "gradient_accumulation_steps"))


def _one_rank_job(timeout_s: float) -> JobComm:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UnsupportedModelError("a DeepSpeed engine without an initialized process group: create it with "
                                    "deepspeed.initialize (which calls deepspeed.init_distributed)")
    return JobComm(dist.get_rank(), dist.get_world_size(), timeout_s)


def _is_ddp(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def _is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def as_judged(record: StepRecord, job: JobView | None) -> StepRecord:
    """What the detector sees: in a multi-rank job the job's loss and top-token share, so that every
    rank's detector gets the same inputs and every rank takes the same path at a spike. Each rank's
    samples stay its own: the detector asks the job whether any rank holds an outlier
    (``SpikeDetector.agree``) on a step above its sample band."""
    if job is None:
        return record
    tokens = replace(record.tokens, top_share=job.top_share) if record.tokens is not None else None
    return replace(record, loss=job.loss, tokens=tokens)


def layer_stats(model: nn.Module, watched: nn.Module, cfg: WatchConfig, kind: str,
                comm: JobComm | None = None) -> LayerStatsCollector:
    if kind != "deepspeed":
        return LayerStatsCollector(watched, cfg.layer_grouping)
    if cfg.remedy is not None:
        raise ConfigError(f"remedy={cfg.remedy!r} is not supported under DeepSpeed (the gradient lives in ZeRO's "
                          "buffers); leave remedy=None")
    from gradloc.adapters.deepspeed.stats import DeepSpeedLayerStats

    return DeepSpeedLayerStats(model, cfg.layer_grouping, comm)


def check_model(model: nn.Module, cfg: WatchConfig) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"gradloc.watch expects a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModelError("the model has no trainable parameters")
    return uncompiled(model)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module under a ``torch.compile(model)`` wrapper (the same parameters, hooks and names, no
    "_orig_mod." prefix); any other module as it is. Hooks registered on it before the wrapper's first
    call are traced into the graph (collector/compiled.py)."""
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return model
