"""What every training-loop integration does around gradloc's :class:`~gradloc.engine.monitor.Monitor`
when the loop, not the user, owns the forward, the backward and the optimizer step (Lightning,
Accelerate): open each micro-batch's block before its forward and close it after its backward, sum
the step's loss, keep the micro-batches for the probes, and call ``end_step`` after the step's last
backward and before clipping — never raising into the loop after the first step.

A loop integration gives three things: ``view(batch)`` → the ``Monitor.micro_batch`` arguments for a
batch (``token_ids``/``loss_mask``/``sample_ids``; None or bad metadata raises on the first step, a setup
mistake, and later leaves the micro-batch out of per-token statistics, counted),
``token_loss(batch)`` → the micro-batch's per-token loss terms (B, T) whose sum is the loss the loop
back-propagates before its own accumulation division (None: no probes, said once), and ``divisor()``
(the loop's accumulation division, so a probe's loss is scaled like the step's). ``context()`` wraps a
probe's forward the way the loop wraps its own (autocast).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Callable, ContextManager, Mapping

import torch

from gradloc.config import WatchConfig
from gradloc.engine.monitor import Monitor, StepReport
from gradloc.errors import BatchMetadataError, ConfigError
from gradloc.integrations.held import HeldBlocks
from gradloc.integrations.hf_batch import causal_view
from gradloc.integrations.provenance import take_sample_infos
from gradloc.records import SampleInfo

View = Callable[[Any], Mapping[str, Any] | None]
TokenLoss = Callable[[Any], torch.Tensor]


class LoopDriver:
    """One monitor's micro-batch and step bookkeeping inside a loop gradloc does not own: the RL integrations'
    :class:`~gradloc.integrations.held.HeldBlocks` (the same blocks, loss and error regimes), fed by the loop's
    callbacks. ``where`` is its tag: counters ``<where>_skipped_micro_batches``… (gradloc/records/events.py).
    ``strict=False``: a typed setup mistake on the first step is counted like a later one (a degraded setup)."""

    def __init__(self, mon: Monitor, where: str, view: View, token_loss: TokenLoss | None,
                 divisor: Callable[[], float], context: Callable[[], ContextManager[Any]] = nullcontext,
                 strict: bool = True) -> None:
        self.mon, self.view, self.token_loss, self.divisor, self.context = mon, view, token_loss, divisor, context
        self.blocks = HeldBlocks(mon, where, strict=strict)

    @property
    def block_open(self) -> bool:
        return self.blocks.held

    @property
    def errors(self) -> int:
        """Failures caught on the training path (each one logged and counted)."""
        return self.blocks.errors

    def take_infos(self, batch: Any) -> list[SampleInfo] | None:
        """The batch's provenance, removed from it in place (integrations/provenance.py), invalid rows counted."""
        return take_sample_infos(batch, self.blocks.drop_provenance)

    def begin(self, batch: Any, infos: list[SampleInfo] | None = None) -> None:
        """Before the micro-batch's forward: open its block (``infos``: its rows' provenance, when the batch had
        some, unless the view gives ``sample_infos`` itself). Bad metadata raises on the first step (a setup
        mistake); after that the micro-batch is left out of per-token statistics (counted)."""
        self.blocks.open(lambda: self._args(batch, infos), payload=batch)

    def add_loss(self, loss: torch.Tensor) -> None:
        """The loss the loop back-propagates for this micro-batch (already divided for accumulation)."""
        self.blocks.add_loss(loss)

    def divide_loss(self, factor: float) -> None:
        """Divide the step's summed loss (e.g. by a GradScaler's scale when the loop handed it scaled)."""
        if self.blocks.loss is not None:
            self.blocks.loss = self.blocks.loss / factor

    def end_micro_batch(self, failed: bool = False) -> None:
        """After the micro-batch's backward (``failed``: it never ran one: the monitor drops it, counted)."""
        self.blocks.close(RuntimeError("the micro-batch ran no backward") if failed else None)

    def end_step(self, *, scaler: Any = None, step: int | None = None) -> StepReport | None:
        """After the step's last backward, before clipping. Raises only a typed setup mistake on the first step."""
        return self.blocks.end_step(self._probe if self.token_loss is not None else None, scaler=scaler, step=step)

    def close(self) -> None:
        if self.blocks.held:
            self.end_micro_batch(failed=True)
        self.blocks.payloads, self.blocks.loss = [], None
        self.blocks.guard(self.mon.close, "close", setup_raises=False)

    def _args(self, batch: Any, infos: list[SampleInfo] | None) -> Mapping[str, Any]:
        tokens = self.mon.hooks is not None
        if not tokens and self.mon.precursors is None:  # per-layer only: the block just counts the micro-batch
            return {"shape": (1, 1)}
        args = self.view(batch)  # per-layer with the precursors: their drivers' rows get the batch's sample ids
        if args is None:
            if not tokens:  # no token ids wanted: the drivers name micro-batch, row and position only
                return {"shape": (1, 1)}
            raise BatchMetadataError("no token ids for this batch (gradloc_batch / view returned None)")
        if infos is not None and args.get("sample_infos") is None:
            args = {**args, "sample_infos": infos}
        return args

    def _probe(self, parts: list[Any]) -> Callable[[int, torch.Tensor], torch.Tensor]:
        token_loss, divisor, context = self.token_loss, self.divisor(), self.context

        def probe(i: int, token_mask: torch.Tensor) -> torch.Tensor:
            with context():
                terms = token_loss(parts[i])  # (B, T) per-token loss terms
            return (terms * token_mask.to(terms.device, terms.dtype)).sum() / divisor
        return probe


def hf_view(batch: Any) -> dict[str, Any] | None:
    """The default view of a batch: a Hugging Face causal-LM batch (a mapping with 2-D integer ``labels``
    or ``shift_labels``): the logits' (B, T) layout, position p scoring ``labels[p + 1]``. None otherwise."""
    if not isinstance(batch, Mapping):
        return None
    view = causal_view(batch)
    return None if view is None else {"token_ids": view.token_ids, "loss_mask": view.loss_mask}


def as_config(value: WatchConfig | Mapping[str, Any] | bool | None) -> WatchConfig | None:
    """A WatchConfig from what a user passes an integration (``gradloc=``): a WatchConfig, a dict of its fields
    (a nested config — ``detector``, ``localizer``, ``precursors`` and its ``drift``, … — may be a dict too),
    None or True (the defaults), False (None: no gradloc)."""
    if value is False:
        return None
    if value is None or value is True:
        return WatchConfig()
    if isinstance(value, WatchConfig):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError("gradloc= takes a WatchConfig, a dict of its fields, None or False; "
                          f"got {type(value).__name__}")
    return _from_mapping(WatchConfig, value, "gradloc")


def _from_mapping(cls: type, value: Mapping[str, Any], where: str) -> Any:
    """``cls(**value)``, each field whose default is itself a config dataclass built from a dict in turn."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    kw = dict(value)
    for name, v in value.items():
        f = known[name]
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else None)
        if isinstance(v, Mapping) and is_dataclass(default):
            kw[name] = _from_mapping(type(default), v, f"{where}.{name}")
    return cls(**kw)
