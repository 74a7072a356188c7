"""gradloc for OpenRLHF 0.11's PPO actor, duck-typed: no openrlhf, deepspeed or ray import.

    from gradloc.integrations.openrlhf import GradlocOpenRLHF
    trainer = ActorPPOTrainer(...)                 # inside PolicyModelActor.fit
    hooks = GradlocOpenRLHF(trainer, job="ppo")    # WatchConfig fields

What it patches, on the objects (``detach()`` restores them), and why:

- ``trainer.training_step(experience, kl_ctl, step, loss_batch_info)``: one micro-batch — the actor's
  forward, PolicyLoss (+ KL, entropy), ``strategy.backward`` and ``strategy.optimizer_step``. The
  wrapper maps the experience to gradloc's layout (:mod:`gradloc.integrations.openrlhf_batch`) and
  holds ``mon.micro_batch`` open around it.
- a forward hook on ``trainer.actor`` (removed by ``detach()``): keeps the output's token entropies when the step
  computes them (OpenRLHF asks the actor for them when ``actor.entropy_coef`` is set, 0 included), for
  ``mon.rl_fields(entropy=...)``: the policy's entropy series and the drift detector's ``rl_entropy``. Nothing is
  computed that the step does not compute.
- ``trainer.actor_loss_fn``: records the action log-probs the loss sees, for ``mon.rl_fields``.
- ``trainer.strategy.backward``: records each loss ÷ gas (DeepSpeed scales the backward by 1/gas).
- ``trainer.strategy.optimizer_step``: DeepSpeed clips and steps inside ``engine.step()`` at the
  gradient-accumulation boundary, so at the boundary ``mon.end_step`` runs first, then the original.

A probe replays the original ``training_step`` on a copy of the experience whose ``action_mask`` is
× the token mask, with the step's ``loss_batch_info`` (the normalizers, computed from the unmasked
masks), and takes the loss at ``strategy.backward`` instead of running it (nor the optimizer, EMA or
metrics). For a token-level PPO loss (``policy_loss_type="ppo"``, ``token_level_loss``, a token-level IS
correction) with the KL and entropy terms that is exactly Σ over the masked tokens of the training
loss's terms; anything else is refused at attach (``probes=False`` skips probes).

DeepSpeed: the monitor watches the engine itself (``gradloc.watch(engine)``), so every ZeRO stage 0–3
works, OpenRLHF's default ZeRO-2 included: gradloc reads the gradient where the stage keeps it and
combines the ranks' partitions (docs/deepspeed.md), and the ranks detect, localize and probe as one
job. A probe under DeepSpeed must not run ``.backward()`` (ZeRO's reduction hooks would fire) nor the
engine's forward: during it ``actor.model`` is the engine's raw module, and the closure *returns* the
captured loss, which gradloc differentiates with ``torch.autograd.grad`` and scales by 1/gas itself (as
``engine.backward`` does). Under ZeRO-3 every rank takes part in every probe (its forward gathers
parameters). An engine that is not DeepSpeed (a plain module behind the same methods) is watched
through its ``module``, and a probe's loss is ÷ gas there.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch

from gradloc.config import WatchConfig
from gradloc.errors import AttachError, ConfigError, ProbeError, UnsupportedModelError
from gradloc.integrations.held import HeldBlocks
from gradloc.integrations.openrlhf_batch import ExperienceLayout, PromptProvenance, layout, rl_fields
from gradloc.integrations.patch import Patches, run_after

log = logging.getLogger("gradloc")

__all__ = ["ExperienceLayout", "GradlocOpenRLHF", "PromptProvenance", "install", "layout", "masked_loss", "rl_fields"]


@dataclass
class _Part:
    experience: Any
    kl_ctl: Any
    step: Any
    loss_batch_info: Any
    layout: ExperienceLayout


class _Captured(Exception):
    def __init__(self, loss: torch.Tensor) -> None:
        super().__init__("probe loss captured")
        self.loss = loss


class GradlocOpenRLHF:
    """gradloc on one ``ActorPPOTrainer``-like trainer (see the module docstring).

    ``packed``: the layout the actor runs (default ``trainer.args.ds.packing_samples``).
    ``sample_ids(experience) -> ids``: one per row (default: ``experience.index`` when it has one per row).
    ``provenance(experience) -> [(source, origin)]``: one per row (:class:`PromptProvenance`; OpenRLHF's experience
    carries no datasource or dataset index of its own).
    """

    def __init__(self, trainer: Any, mon: Any = None, *, config: WatchConfig | None = None, probes: bool | None = None,
                 packed: bool | None = None, sample_ids: Callable[[Any], Any] | None = None,
                 provenance: Callable[[Any], Any] | None = None,
                 on_report: Callable[[Any], None] | None = None, **overrides: Any) -> None:
        strategy = getattr(trainer, "strategy", None)
        engine = getattr(getattr(trainer, "actor", None), "model", getattr(trainer, "actor", None))
        probes = _check(trainer, strategy, engine, mon, probes)
        self.trainer, self.strategy, self.probes, self.on_report = trainer, strategy, probes, on_report
        self.engine = engine
        self.packed = bool(_arg(trainer, "ds", "packing_samples", False)) if packed is None else packed
        self.sample_ids, self.provenance = sample_ids, provenance
        self.own_monitor = mon is None
        self.mon = mon if mon is not None else _watch(engine, trainer, config, overrides)
        self.blocks = HeldBlocks(self.mon, "openrlhf")
        self._held: _Part | None = None  # the watched micro-batch inside training_step
        self._in_step = self._probing = False
        self._entropy: Any = None  # the actor output's token entropies of the held micro-batch (None: not computed)
        patches = ((trainer, "training_step", self._training_step), (trainer, "actor_loss_fn", self._loss_fn),
                   (strategy, "backward", self._backward), (strategy, "optimizer_step", self._optimizer_step))
        self.patches = Patches(patches)
        self._orig = self.patches.orig
        self._entropy_hook = trainer.actor.register_forward_hook(lambda _m, _a, out: self._keep_entropy(out))
        trainer._gradloc_hooks = self

    @property
    def reports(self) -> Any:
        return self.blocks.reports

    def detach(self) -> None:
        """Restore the trainer and strategy; close the monitor if these hooks made it."""
        self.patches.undo()
        self._entropy_hook.remove()
        self.trainer._gradloc_hooks = None
        self.blocks.close()
        if self.own_monitor:
            self.mon.close()

    # -- the patched methods ------------------------------------------------------------------
    def _training_step(self, experience: Any, kl_ctl: Any, step: Any, loss_batch_info: Any = None, *args: Any,
                       **kwargs: Any) -> Any:
        self.blocks.close()
        lay = self._layout_or_none(experience)
        part = _Part(experience, kl_ctl, step, loss_batch_info, lay) if lay is not None else None
        self._held = part if part is not None and self.blocks.open(lay.micro_batch_kwargs, part) is not None else None
        self._in_step = True
        try:
            status = self._orig["training_step"](experience, kl_ctl, step, loss_batch_info, *args, **kwargs)
        except BaseException as exc:
            self.blocks.close(exc)
            raise
        finally:
            self._in_step, self._held, self._entropy = False, None, None
        self.blocks.close()  # no boundary in this call: the block ends with the call
        return status

    def _keep_entropy(self, out: Any) -> None:  # the actor's forward hook: returns None (the output unchanged)
        if self._held is not None and not self._probing and isinstance(out, tuple) and len(out) == 2:
            try:
                self._entropy = out[1].entropy  # set by the actor under return_entropy=True
            except Exception:  # noqa: BLE001 - not computed this step (a ModelOutput or dict without it)
                self._entropy = None

    def _loss_fn(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 *args: Any, **kwargs: Any) -> Any:
        held, entropy, self._entropy = self._held, self._entropy, None
        if held is not None and not self._probing and self.blocks.held:
            clip = _clip_eps(self._orig["actor_loss_fn"])
            self.blocks.guard(lambda: self.mon.rl_fields(**rl_fields(held.layout, held.experience, log_probs,
                                                                     clip_eps=clip, entropy=entropy)), "rl_fields")
        return self._orig["actor_loss_fn"](log_probs, old_log_probs, advantages, *args, **kwargs)

    def _backward(self, loss: torch.Tensor, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        if self._in_step and not self._probing:
            self.blocks.guard(lambda: self.blocks.add_loss(loss.detach() / self._gas()), "loss")
        return self._orig["backward"](loss, model, optimizer, **kwargs)

    def _optimizer_step(self, optimizer: Any, model: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        engine = getattr(model, "model", model)
        boundary = getattr(engine, "is_gradient_accumulation_boundary", None)
        if self._in_step and not self._probing and (not callable(boundary) or boundary()):
            probe_for = self._probe_for if self.probes and self.mon.hooks is not None else None
            report = self.blocks.end_step(probe_for)
            if report is not None and self.on_report is not None:
                self.blocks.guard(lambda: self.on_report(report), "on_report")
        return self._orig["optimizer_step"](optimizer, model, scheduler, *args, **kwargs)

    # -- helpers ------------------------------------------------------------------------------
    def _layout_or_none(self, experience: Any) -> ExperienceLayout | None:
        if self.mon.hooks is None:
            return None

        def make() -> ExperienceLayout:
            ids = self.sample_ids(experience) if self.sample_ids is not None else None
            rows = self.blocks.guard(lambda: self.provenance(experience), "provenance") if self.provenance else None
            return layout(experience, packed=self.packed, sample_ids=ids, provenance=rows)

        return self.blocks.guard(make, "layout") if self.blocks.stepped else make()

    def _gas(self) -> int:
        engine = getattr(self.trainer.actor, "model", None)
        steps = getattr(engine, "gradient_accumulation_steps", None)
        if callable(steps):
            return max(int(steps()), 1)
        return max(int(getattr(self.strategy, "accumulated_gradient", 1) or 1), 1)

    def _probe_for(self, parts: list[_Part]) -> Callable[[int, torch.Tensor], torch.Tensor]:
        dynamic = bool(_arg(self.trainer, "train", "dynamic_batch_enable", False))
        deepspeed = self.mon.job.data.wraps_backward
        gas = 1 if deepspeed else self._gas()  # under DeepSpeed gradloc applies engine.backward's 1/gas itself

        def probe(i: int, token_mask: torch.Tensor) -> torch.Tensor:
            p = parts[i]
            if p.loss_batch_info is None and not dynamic:
                raise ProbeError("training_step got no loss_batch_info: replayed with a masked action_mask it "
                                 "would recompute the normalizers from that mask")
            self._probing = True
            try:
                with _raw_module(self.trainer.actor, self.engine) if deepspeed else contextlib.nullcontext():
                    return masked_loss(self.trainer, p.experience, token_mask, p.layout, kl_ctl=p.kl_ctl, step=p.step,
                                       loss_batch_info=p.loss_batch_info, gas=gas,
                                       training_step=self._orig["training_step"])
            finally:
                self._probing = False

        return probe


def masked_loss(trainer: Any, experience: Any, token_mask: torch.Tensor, lay: ExperienceLayout, *, kl_ctl: Any,
                step: Any, loss_batch_info: Any, gas: int = 1, training_step: Callable[..., Any] | None = None
                ) -> torch.Tensor:
    """The loss ``trainer.training_step`` builds for ``experience`` with ``action_mask`` × ``token_mask``
    (``lay``'s shape), ÷ ``gas`` as DeepSpeed scales it — taken at ``strategy.backward``, which is not
    run (nor anything after it: optimizer, EMA, metrics). ``loss_batch_info``: the step's normalizers."""
    exp = copy.copy(experience)
    exp.info = dict(getattr(experience, "info", None) or {})
    am = experience.action_mask
    exp.action_mask = am * lay.to_actions(token_mask.to(torch.bool)).to(device=am.device, dtype=am.dtype)
    strategy = trainer.strategy
    had, saved = "backward" in vars(strategy), vars(strategy).get("backward")

    def capture(loss: torch.Tensor, *_: Any, **__: Any) -> None:
        raise _Captured(loss)

    strategy.backward = capture
    try:
        (training_step or trainer.training_step)(exp, kl_ctl, step, loss_batch_info)
    except _Captured as got:
        return got.loss / gas
    finally:
        if had:
            strategy.backward = saved
        else:
            del strategy.backward
    raise ProbeError("training_step returned without calling strategy.backward")


@contextlib.contextmanager
def _raw_module(actor: Any, engine: Any) -> Iterator[None]:
    """``actor.model`` is the engine's raw module for the duration (a probe must not run the DeepSpeed
    engine's forward, whose hooks belong to training)."""
    actor.model = engine.module
    try:
        yield
    finally:
        actor.model = engine


def install(trainer_cls: type, **kwargs: Any) -> Callable[[], None]:
    """Patch ``trainer_cls.__init__`` (OpenRLHF's ``ActorPPOTrainer``) so every trainer it builds gets
    :class:`GradlocOpenRLHF` (``kwargs``), stored as ``trainer.gradloc``. Call it in the actor's process
    before the trainer is built (e.g. from a Ray ``worker_process_setup_hook``). Returns an uninstall
    function."""
    def attach(trainer: Any) -> None:
        if type(trainer) is trainer_cls:
            trainer.gradloc = GradlocOpenRLHF(trainer, **kwargs)

    return run_after(trainer_cls, "__init__", attach)


def _check(trainer: Any, strategy: Any, engine: Any, mon: Any, probes: bool | None) -> bool:
    """Refuse what cannot be watched (typed errors at attach); whether to probe."""
    if getattr(trainer, "_gradloc_hooks", None) is not None:
        raise AttachError("this trainer already has gradloc hooks; detach() them first")
    for obj, name in ((trainer, "training_step"), (trainer, "actor_loss_fn"), (trainer, "actor"),
                      (strategy, "backward"), (strategy, "optimizer_step")):
        if not hasattr(obj, name):
            raise UnsupportedModelError(f"no {name}: not an OpenRLHF ActorPPOTrainer with a DeepSpeed strategy")
    if getattr(strategy, "ring_attn_group", None) is not None:
        raise UnsupportedModelError("ring attention splits each packed row across ranks; gradloc needs the "
                                    "whole row on one rank (ring_attn_size=1)")
    stage = _zero_stage(engine)
    if mon is not None and stage >= 1 and not mon.job.data.own_partitions:
        raise UnsupportedModelError(f"under ZeRO stage {stage} p.grad is gone by the time DeepSpeed clips (moved "
                                    "into its partitions), and this monitor reads p.grad: pass no mon= (the hooks "
                                    "then watch the engine itself) or a monitor made with gradloc.watch(engine)")
    inexact = _inexact(trainer)
    if probes and inexact:
        raise ConfigError(f"probes mask the loss through action_mask, which is not exact with {inexact}; "
                          "pass probes=False for attribution-only incidents")
    if probes is None:
        if inexact:
            log.warning("gradloc (openrlhf): probes off: masking action_mask is not exact with %s", inexact)
        return inexact is None
    return probes


def _inexact(trainer: Any) -> str | None:
    """Why replaying the loss with action_mask × mask would not restrict it exactly (None: it does)."""
    fn = trainer.actor_loss_fn
    if getattr(fn, "policy_loss_type", "ppo") != "ppo":
        return f"policy_loss_type={fn.policy_loss_type!r} (a sequence-level ratio)"
    if not getattr(fn, "token_level_loss", True):
        return "token_level_loss=False (per-sequence means over the action mask)"
    if getattr(fn, "is_correction_level", "off") == "seq":  # OpenRLHF 0.11.2
        return "is_correction_level='seq' (a per-sequence IS statistic over the action mask)"
    if getattr(fn, "enable_vllm_is_correction", False) and getattr(fn, "vllm_is_correction_type", "tis") == "seq-mask-tis":
        return "vllm_is_correction_type='seq-mask-tis' (a sequence filter over the action mask)"  # 0.11.0
    if getattr(trainer, "aux_loss", False):
        return "the MoE aux loss (not a per-token term)"
    return None


def _zero_stage(engine: Any) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


def _clip_eps(fn: Any) -> tuple[float, float] | None:
    lo, hi = getattr(fn, "clip_eps_low", None), getattr(fn, "clip_eps_high", None)
    return (float(lo), float(hi)) if lo is not None and hi is not None else None


def _arg(trainer: Any, group: str, name: str, default: Any) -> Any:
    return getattr(getattr(getattr(trainer, "args", None), group, None), name, default)


def _watch(engine: Any, trainer: Any, config: WatchConfig | None, overrides: dict[str, Any]) -> Any:
    """A DeepSpeed engine is watched itself (a job over its ranks, every ZeRO stage); anything else through
    its ``module``."""
    from gradloc.adapters.pytorch import watch
    from gradloc.parallel.data import is_deepspeed

    cfg = replace(config or WatchConfig(), **overrides)
    if is_deepspeed(engine):
        return watch(engine, config=cfg)  # DeepSpeed steps its own (flat) optimizer: no optimizer to watch
    opt = getattr(trainer, "actor_optim", None)
    return watch(getattr(engine, "module", engine), opt if isinstance(opt, torch.optim.Optimizer) else None, config=cfg)
