"""What every training-loop integration does around gradloc's :class:`~gradloc.engine.monitor.Monitor`
when the loop, not the user, owns the forward, the backward and the optimizer step (Lightning,
Accelerate): open each micro-batch's block before its forward and close it after its backward, sum
the step's loss, keep the micro-batches for the probes, and call ``end_step`` after the step's last
backward and before clipping — never raising into the loop after the first step.

A loop integration gives three things: ``view(batch)`` → the ``Monitor.micro_batch`` arguments for a
batch (``token_ids``/``loss_mask``/``sample_ids``, or None: left out of per-token statistics, counted),
``token_loss(batch)`` → the micro-batch's per-token loss terms (B, T) whose sum is the loss the loop
back-propagates before its own accumulation division (None: no probes, said once), and ``divisor()``
(the loop's accumulation division, so a probe's loss is scaled like the step's). ``context()`` wraps a
probe's forward the way the loop wraps its own (autocast).
"""
from __future__ import annotations

import logging
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ContextManager, Mapping

import torch

from gradloc.config import DetectorConfig, LocalizerConfig, WatchConfig
from gradloc.engine.monitor import Monitor, StepReport
from gradloc.errors import BatchMetadataError, ConfigError, GradlocError
from gradloc.integrations.hf_batch import causal_view

log = logging.getLogger("gradloc")

View = Callable[[Any], Mapping[str, Any] | None]
TokenLoss = Callable[[Any], torch.Tensor]


@dataclass
class LoopDriver:
    """One monitor's micro-batch and step bookkeeping inside a loop gradloc does not own.

    ``where`` names the integration in counters and log lines (``lightning_skipped_micro_batches``…).
    """

    mon: Monitor
    where: str
    view: View
    token_loss: TokenLoss | None
    divisor: Callable[[], float]
    context: Callable[[], ContextManager[Any]] = nullcontext
    strict: bool = True  # a typed setup mistake on the first step raises (False: counted like any later one)
    errors: int = 0  # failures caught on the training path (each one logged and counted)
    _parts: list[Any] = field(default_factory=list)  # the step's micro-batches, for the probes
    _loss: torch.Tensor | None = None
    _block: ExitStack | None = None
    _batch: Any = None
    _stepped: bool = False

    @property
    def block_open(self) -> bool:
        return self._block is not None

    def begin(self, batch: Any) -> None:
        """Before the micro-batch's forward: open its block. Bad metadata raises on the first step (a
        setup mistake), and after that leaves the micro-batch out of per-token statistics (counted)."""
        if self._block is not None:  # the previous micro-batch never reached its backward (skipped)
            self.end_micro_batch(failed=True)
        stack = ExitStack()
        try:
            args = self._args(batch)
            stack.enter_context(self.mon.micro_batch(**args))
        except GradlocError:
            stack.close()
            if self.strict and not self._stepped:
                raise
            self._count("skipped_micro_batches", "micro-batch left out of per-token statistics")
            return
        except Exception:  # a user's view function failing must not stop training
            stack.close()
            self._count("errors", "opening a micro-batch failed")
            return
        self._block, self._batch = stack, batch

    def add_loss(self, loss: torch.Tensor) -> None:
        """The loss the loop back-propagates for this micro-batch (already divided for accumulation)."""
        loss = loss.detach()
        self._loss = loss if self._loss is None else self._loss + loss

    def divide_loss(self, factor: float) -> None:
        """Divide the step's summed loss (e.g. by a GradScaler's scale when the loop handed it scaled)."""
        if self._loss is not None:
            self._loss = self._loss / factor

    def end_micro_batch(self, failed: bool = False) -> None:
        """After the micro-batch's backward (``failed``: it never ran one: left out, counted)."""
        stack, batch, self._block, self._batch = self._block, self._batch, None, None
        if stack is None:
            return
        try:
            if failed:  # the block sees an exception: Monitor.micro_batch counts a failed micro-batch
                stack.__exit__(RuntimeError, RuntimeError("no backward"), None)
            else:
                stack.close()
                if self.mon.hooks is not None:
                    self._parts.append(batch)
        except Exception:
            self._count("errors", "closing a micro-batch failed")

    def end_step(self, *, scaler: Any = None, step: int | None = None) -> StepReport | None:
        """After the step's last backward, before clipping. Raises only a typed setup mistake on the first step."""
        if self._block is not None:
            self.end_micro_batch()
        parts, loss = self._parts, self._loss
        self._parts, self._loss = [], None
        probe = self._probe(parts) if parts and self.token_loss is not None else None
        first, self._stepped = not self._stepped, True
        try:
            return self.mon.end_step(loss, probe=probe, scaler=scaler, step=step)
        except Exception as exc:
            if self.strict and first and isinstance(exc, GradlocError):
                raise
            self._count("end_step_errors", "end_step failed")
            return None

    def close(self) -> None:
        if self._block is not None:
            self.end_micro_batch(failed=True)
        self._parts, self._loss = [], None
        try:
            self.mon.close()
        except Exception:
            self._count("errors", "closing the monitor failed")

    def _args(self, batch: Any) -> Mapping[str, Any]:
        if self.mon.hooks is None:  # per-layer only: the block just counts the micro-batch
            return {"shape": (1, 1)}
        args = self.view(batch)
        if args is None:
            raise BatchMetadataError(f"{self.where}: no token ids for this batch (gradloc_batch returned None)")
        return args

    def _probe(self, parts: list[Any]) -> Callable[[int, torch.Tensor], torch.Tensor]:
        token_loss, divisor, context = self.token_loss, self.divisor(), self.context

        def probe(i: int, token_mask: torch.Tensor) -> torch.Tensor:
            with context():
                terms = token_loss(parts[i])  # (B, T) per-token loss terms
            return (terms * token_mask.to(terms.device, terms.dtype)).sum() / divisor
        return probe

    def _count(self, what: str, message: str) -> None:
        self.errors += what != "skipped_micro_batches"
        self.mon.counters[f"{self.where}_{what}"] += 1
        log.warning("gradloc (%s): %s at step %d", self.where, message, self.mon.step, exc_info=True)


def hf_view(batch: Any) -> dict[str, Any] | None:
    """The default view of a batch: a Hugging Face causal-LM batch (a mapping with 2-D integer ``labels``
    or ``shift_labels``): the logits' (B, T) layout, position p scoring ``labels[p + 1]``. None otherwise."""
    if not isinstance(batch, Mapping):
        return None
    view = causal_view(batch)
    return None if view is None else {"token_ids": view.token_ids, "loss_mask": view.loss_mask}


def as_config(value: WatchConfig | Mapping[str, Any] | bool | None) -> WatchConfig | None:
    """A WatchConfig from what a user passes an integration (``gradloc=``): a WatchConfig, a dict of its fields
    (``detector``/``localizer`` may be dicts), None or True (the defaults), False (None: no gradloc)."""
    if value is False:
        return None
    if value is None or value is True:
        return WatchConfig()
    if isinstance(value, WatchConfig):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError("gradloc= takes a WatchConfig, a dict of its fields, None or False; "
                          f"got {type(value).__name__}")
    known = {f.name for f in fields(WatchConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"unknown WatchConfig field(s) {unknown}; known: {sorted(known)}")
    kw = dict(value)
    for key, cls in (("detector", DetectorConfig), ("localizer", LocalizerConfig)):
        if isinstance(kw.get(key), Mapping):
            kw[key] = cls(**kw[key])
    return WatchConfig(**kw)
