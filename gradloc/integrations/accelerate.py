"""gradloc for an Accelerate loop: two lines change.

    gl = GradlocAccelerate(accelerator, model, optimizer, token_loss=lambda m, b: ..., job="sft")
    for batch in loader:
        with gl.accumulate(batch):                  # was: accelerator.accumulate(model)
            loss = model(**batch).loss
            gl.backward(loss)                       # was: accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); optimizer.zero_grad()
    gl.close()

``accumulate(batch)`` enters ``accelerator.accumulate(model)`` (which decides ``sync_gradients`` for
this micro-batch) and opens the micro-batch's gradloc block around the forward. ``backward(loss)`` runs
``accelerator.backward(loss)`` (which divides by ``gradient_accumulation_steps``), closes the block and,
on the step's last micro-batch (``sync_gradients``), runs ``end_step``: after the last backward, before
the loop clips. ``token_loss(model, batch)`` → (B, T) per-token loss terms whose sum is the loss given
to ``backward`` (for an HF causal LM: ``causal_lm_token_loss(model(input_ids=...).logits, labels)``); the
probes run it on the unwrapped model under ``accelerator.autocast()``, divided like ``backward`` does.
``view(batch)`` → token ids (default: an HF batch's shifted labels). A multi-process DDP model is
watched as a DDP job. DeepSpeed is refused: its engine clips and steps inside ``backward``.

Provenance: ``accumulate(batch)`` takes a :class:`~gradloc.integrations.provenance.ProvenanceCollator` batch's
infos (or its provenance columns collated into lists) out of the batch *in place*, before ``model(**batch)``
runs, and the micro-batch carries one SampleInfo per row.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping

import torch

try:
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("gradloc.integrations.accelerate needs the 'hf' extra: pip install 'gradloc[hf]'") from exc

from gradloc.adapters.pytorch import watch
from gradloc.config import WatchConfig
from gradloc.engine.monitor import Monitor, StepReport
from gradloc.errors import ConfigError, UnsupportedModelError
from gradloc.integrations.hf_batch import causal_lm_token_loss
from gradloc.integrations.loop import LoopDriver, View, as_config, hf_view

log = logging.getLogger("gradloc")
__all__ = ["GradlocAccelerate", "causal_lm_token_loss"]


class GradlocAccelerate:
    """gradloc around a prepared ``accelerate.Accelerator`` loop (the model and optimizer as ``prepare``
    returned them). ``config``: a WatchConfig or a dict of its fields; ``overrides``: WatchConfig fields."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any = None, *,
                 token_loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None, view: View | None = None,
                 config: WatchConfig | Mapping[str, Any] | None = None, decode: Any = None,
                 sinks: tuple[Any, ...] = (), **overrides: Any) -> None:
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise UnsupportedModelError("DeepSpeed clips and steps inside accelerator.backward: no point between the "
                                        "last backward and clipping exists; use gradloc.watch(engine) in a DeepSpeed loop")
        cfg = as_config(config)
        if cfg is None:
            raise ConfigError("config=False: to train without gradloc, do not wrap the loop")
        cfg = replace(cfg, **overrides) if overrides else cfg
        self.accelerator, self.model = accelerator, model
        inner = accelerator.unwrap_model(model)
        target = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else inner  # DDP: a job
        mon = watch(target, getattr(optimizer, "optimizer", optimizer), config=cfg,
                    decode=getattr(decode, "decode", decode), sinks=sinks)
        bound = (lambda batch: token_loss(inner, batch)) if token_loss is not None else None
        if token_loss is None and mon.hooks is not None:
            log.warning("gradloc (accelerate): no token_loss=: per-token attribution without probes, so culprits "
                        "are not verified")
        self.driver = LoopDriver(mon, "accelerate", view or hf_view, bound,
                                 divisor=lambda: float(accelerator.gradient_accumulation_steps),
                                 context=accelerator.autocast)
        self.last: StepReport | None = None  # the last optimizer step's report

    @property
    def monitor(self) -> Monitor:
        return self.driver.mon

    @contextmanager
    def accumulate(self, batch: Any) -> Iterator[None]:
        """``accelerator.accumulate(model)`` plus this micro-batch's gradloc block (forward and backward)."""
        with self.accelerator.accumulate(self.model):
            self.driver.begin(batch, self.driver.take_infos(batch))  # provenance leaves the batch, in place
            try:
                yield
            finally:
                if self.driver.block_open:  # no backward ran (an exception, or backward not through gl)
                    self.driver.end_micro_batch(failed=True)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``accelerator.backward(loss)``; on the step's last micro-batch, gradloc's end of step (before clipping)."""
        self.accelerator.backward(loss, **kwargs)
        driver = self.driver
        driver.add_loss(loss / self.accelerator.gradient_accumulation_steps)
        driver.end_micro_batch()
        if self.accelerator.sync_gradients:
            self.last = driver.end_step(scaler=self.accelerator.scaler)

    def close(self) -> None:
        self.driver.close()

    def __enter__(self) -> "GradlocAccelerate":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
