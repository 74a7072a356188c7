"""The PyTorch adapter: ``gradloc.watch(model, optimizer)`` -> a :class:`~gradloc.engine.monitor.Monitor`.

``model`` is what the user trains: a module, a ``torch.compile`` wrapper, DDP, an FSDP2 or tensor-parallel
module, a pipeline stage, a DeepSpeed engine; gradloc/parallel/job.py works out the job from it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import nn

from gradloc.config import WatchConfig
from gradloc.engine.lifecycle import ATTACHED
from gradloc.engine.monitor import Monitor, StepReport
from gradloc.errors import AttachError
from gradloc.sinks import Sink


def watch(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
          config: WatchConfig | None = None, decode: Any = None, sinks: Sequence[Sink] = (),
          **overrides: Any) -> Monitor:
    """Attach a monitor. ``overrides`` are WatchConfig fields (``job=``, ``incident_path=`` …)."""
    if overrides:
        config = replace(config or WatchConfig(), **overrides)
    if model in ATTACHED:
        raise AttachError("this model already has a gradloc monitor attached; detach() it first")
    mon = Monitor(model, optimizer, config, decode, sinks)
    try:
        return mon.attach()
    except BaseException:
        mon.close()
        raise


__all__ = ["Monitor", "StepReport", "watch"]
