"""gradloc for verl 0.9's engine workers (FSDP), duck-typed: no verl, tensordict or ray import.

In the module named by ``actor_rollout_ref.model.external_lib`` (imported inside every Ray worker
before its engines are built)::

    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from gradloc.integrations.verl import install
    install(FSDPEngineWithLMHead, job="grpo-7b")          # WatchConfig fields

Or on one engine: ``hooks = GradlocVerlHooks(engine, job=...)``.

What it patches, on the engine *instance* (``detach()`` restores the class methods), and why:

- ``forward_step(micro_batch, loss_function, forward_only)``: verl's per-micro-batch forward. The
  wrapper maps the micro-batch to gradloc's packed layout (:mod:`gradloc.integrations.verl_batch`),
  enters ``mon.micro_batch`` and hands the engine a loss function that records the ``log_probs`` the
  real loss sees; after the loss it gives ``mon.rl_fields`` logp, old/rollout log-probs, advantages,
  ratio and clipped, and the token entropies when the engine computed them (``calculate_entropy``). The block stays open: verl calls ``loss.backward()`` after ``forward_step``
  returns, so the block closes when the next ``forward_step`` starts. Forward-only calls
  (``compute_log_prob``, the reference policy) pass straight through.
- ``forward_backward_batch(data, loss_function, forward_only)``: closes the last micro-batch's
  block once its backward has run.
- ``optimizer_step()``: verl clips inside it (and logs the pre-clip norm as ``actor/grad_norm``), so
  ``mon.end_step`` runs first, with the probe closure, then the original.

A probe re-runs the original ``forward_step`` on the stored micro-batch with
:func:`~gradloc.integrations.verl_batch.masked_loss_function` (``rollout_is_weights`` × mask, same
``agg_loss`` normalization). The monitor watches ``engine.module``: verl's FSDP2 engine shards it with
``fully_shard``, so gradloc makes it a job of kind "fsdp" (``gradloc/parallel``): every rank judges the
job's gradient, and since a probe's forward all-gathers parameters and its backward reduce-scatters,
every rank runs every probe in lockstep (a rank with nothing to probe runs its first micro-batch with an
empty mask); the reduce-scatter combines the probe gradients over the ranks. FSDP1 (verl's
``strategy: fsdp``: flat parameters) is refused at attach: use ``strategy=fsdp2``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from gradloc.config import WatchConfig
from gradloc.errors import AttachError, UnsupportedModelError
from gradloc.integrations.held import HeldBlocks
from gradloc.integrations.patch import Patches, patched, run_after
from gradloc.integrations.verl_batch import PAD_SAMPLE, VerlLayout, layout, masked_loss_function, rl_fields

__all__ = ["GradlocVerlHooks", "PAD_SAMPLE", "VerlLayout", "install", "layout", "masked_loss_function", "rl_fields"]

_PATCHED = ("forward_step", "forward_backward_batch", "optimizer_step")


@dataclass
class _Part:
    """What a probe needs to replay one micro-batch."""

    micro_batch: Any
    loss_function: Callable[..., Any]
    layout: VerlLayout


class GradlocVerlHooks:
    """gradloc on one verl ``FSDPEngineWithLMHead``-like engine (see the module docstring).

    ``mon``: a monitor to use; by default one is made with ``gradloc.watch(engine.module,
    engine.optimizer, config=config, **overrides)`` (rank and world size from torch.distributed).
    ``clip_ratio``: (low, high) for ``clipped``; by default read from the loss function's actor
    config (``partial(ppo_loss, config=...)``: clip_ratio_low/high or clip_ratio).
    ``probes``: verify culprits with masked-loss probes (extra forward/backward passes; default on,
    on every rank of an FSDP2 job in lockstep). Off, incidents come from attribution alone.
    """

    def __init__(self, engine: Any, mon: Any = None, *, config: WatchConfig | None = None, probes: bool | None = None,
                 clip_ratio: tuple[float, float] | None = None, on_report: Callable[[Any], None] | None = None,
                 **overrides: Any) -> None:
        if any(patched(engine, n) for n in _PATCHED):
            raise AttachError("this engine already has gradloc hooks; detach() them first")
        if getattr(engine, "use_ulysses_sp", False) or int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1) > 1:
            raise UnsupportedModelError("Ulysses sequence parallelism splits each packed row across ranks; gradloc "
                                        "needs the whole row on one rank (ulysses_sequence_parallel_size=1)")
        for name in ("module", *_PATCHED):
            if not hasattr(engine, name):
                raise UnsupportedModelError(f"{type(engine).__name__} has no {name}: not a verl FSDP engine")
        if _is_fsdp1(engine.module):
            raise UnsupportedModelError("verl's FSDP1 engine (strategy=fsdp) flattens parameters, which gradloc does "
                                        "not read; set actor.strategy=fsdp2 (fully_shard), which gradloc watches as "
                                        "one job")
        probes = True if probes is None else bool(probes)
        self.engine = engine
        self.own_monitor = mon is None
        self.mon = mon if mon is not None else _watch(engine, config, overrides)
        self.probes, self.clip_ratio, self.on_report = probes, clip_ratio, on_report
        self.blocks = HeldBlocks(self.mon, "verl")
        self.patches = Patches([(engine, "forward_step", self._forward_step),
                                (engine, "forward_backward_batch", self._forward_backward_batch),
                                (engine, "optimizer_step", self._optimizer_step)])
        self._orig = self.patches.orig

    @property
    def reports(self) -> Any:
        return self.blocks.reports

    def detach(self) -> None:
        """Restore the engine's methods; close the monitor if these hooks made it."""
        self.patches.undo()
        self.blocks.close()
        if self.own_monitor:
            self.mon.close()

    # -- the patched methods ------------------------------------------------------------------
    def _forward_step(self, micro_batch: Any, loss_function: Any = None, forward_only: bool = False) -> Any:
        orig = self._orig["forward_step"]
        if forward_only or loss_function is None or not torch.is_grad_enabled():
            return orig(micro_batch, loss_function=loss_function, forward_only=forward_only)
        self.blocks.close()  # the previous micro-batch's backward has run
        lay = self._layout_or_none(micro_batch)
        meta = None if lay is None else self.blocks.open(lay.micro_batch_kwargs, _Part(micro_batch, loss_function, lay))
        seen: dict[str, Any] = {}

        def recording(*args: Any, **kw: Any) -> Any:
            if "model_output" in kw:  # the loss call (verl also passes the loss function as a logits processor)
                out = kw["model_output"]
                seen.update(log_probs=out.get("log_probs"), entropy=out.get("entropy"), data=kw.get("data"))
            return loss_function(*args, **kw)

        try:
            loss, output = orig(micro_batch, loss_function=recording if meta is not None else loss_function,
                                forward_only=False)
        except BaseException as exc:
            self.blocks.close(exc)
            raise
        if meta is not None and "data" in seen:
            self.blocks.guard(lambda: self.mon.rl_fields(**rl_fields(
                lay, seen["data"], seen["log_probs"], clip_ratio=self._clip(loss_function), entropy=seen["entropy"])),
                "rl_fields")
        self.blocks.guard(lambda: self.blocks.add_loss(loss), "loss")
        return loss, output

    def _forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        try:
            out = self._orig["forward_backward_batch"](data, loss_function, forward_only=forward_only)
        except BaseException as exc:
            self.blocks.close(exc)
            raise
        self.blocks.close()  # the last micro-batch's backward has run
        return out

    def _optimizer_step(self) -> Any:
        probe_for = self._probe_for if self.probes and self.mon.hooks is not None else None
        report = self.blocks.end_step(probe_for, scaler=getattr(self.engine, "scaler", None))
        if report is not None and self.on_report is not None:
            self.blocks.guard(lambda: self.on_report(report), "on_report")
        return self._orig["optimizer_step"]()

    # -- helpers ------------------------------------------------------------------------------
    def _layout_or_none(self, micro_batch: Any) -> VerlLayout | None:
        def make() -> VerlLayout:
            lay = layout(micro_batch)
            pad = getattr(self.engine, "_get_packed_pad_size", None)  # pad_to_length: a static pad after the row
            size = int(pad(lay.n_values)) if callable(pad) and lay.packed else 0
            return layout(micro_batch, pad_size=size) if size else lay

        if self.mon.hooks is None:  # per-layer statistics only: no per-token blocks
            return None
        return self.blocks.guard(make, "layout") if self.blocks.stepped else make()

    def _probe_for(self, parts: list[_Part]) -> Callable[[int, torch.Tensor], torch.Tensor]:
        forward_step = self._orig["forward_step"]

        def probe(i: int, token_mask: torch.Tensor) -> torch.Tensor:
            p = parts[i]
            loss, _ = forward_step(p.micro_batch, loss_function=masked_loss_function(p.loss_function, p.layout,
                                                                                     token_mask), forward_only=False)
            return loss

        return probe

    def _clip(self, loss_function: Any) -> tuple[float, float] | None:
        if self.clip_ratio is not None:
            return self.clip_ratio
        cfg = getattr(loss_function, "keywords", {}).get("config")
        base = getattr(cfg, "clip_ratio", None)
        lo, hi = getattr(cfg, "clip_ratio_low", None), getattr(cfg, "clip_ratio_high", None)
        lo, hi = (lo if lo is not None else base), (hi if hi is not None else base)
        return (float(lo), float(hi)) if lo is not None and hi is not None else None


def install(engine_cls: type, *, only: Callable[[Any], bool] | None = None, **kwargs: Any) -> Callable[[], None]:
    """Patch ``engine_cls.initialize`` so each engine of exactly that class that gets an optimizer
    (the actor; the reference policy has none, the critic is a subclass) gets :class:`GradlocVerlHooks`
    (``kwargs``), stored as ``engine.gradloc``. ``only(engine)`` narrows it further. Returns an
    uninstall function."""
    def attach(engine: Any) -> None:
        if type(engine) is engine_cls and getattr(engine, "optimizer", None) is not None and (only is None or only(engine)):
            engine.gradloc = GradlocVerlHooks(engine, **kwargs)

    return run_after(engine_cls, "initialize", attach)


def _is_fsdp1(module: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP
        return False
    return isinstance(module, torch.nn.Module) and any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def _watch(engine: Any, config: WatchConfig | None, overrides: dict[str, Any]) -> Any:
    from gradloc.adapters.pytorch import watch

    cfg = replace(config or WatchConfig(), **overrides)
    opt = getattr(engine, "optimizer", None)
    return watch(engine.module, opt if isinstance(opt, torch.optim.Optimizer) else None, config=cfg)
