"""gradloc for TRL's ``GRPOTrainer``: ``GradlocGRPOTrainer``, or ``GradlocGRPOMixin`` for a subclass.

    from gradloc.integrations.trl import GradlocGRPOTrainer   # instead of trl.GRPOTrainer

    trainer = GradlocGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                                 gradloc=dict(job="grpo"))      # WatchConfig fields, or a WatchConfig
    trainer.train()
    trainer.gradloc.incidents   # culprits carry .rl (log-probs, advantage, ratio, clipped) and a class

    class MyGRPOTrainer(GradlocGRPOMixin, GRPOTrainer): ...    # the mixin goes first

Why not a ``TrainerCallback``: TRL calls ``on_pre_optimizer_step`` after ``clip_grad_norm_`` (it
sees the clipped gradient), callbacks never get the micro-batches, and the generated batch only
exists inside ``GRPOTrainer._prepare_inputs`` (``training_step`` receives the raw prompt rows).

The mechanism (built on :class:`~gradloc.integrations.transformers.GradlocTrainerMixin`): the
mixin's ``training_step`` runs TRL's, opens ``mon.micro_batch`` when ``_prepare_inputs`` returns the
generated micro-batch (after generation, before the loss forward) and calls ``mon.end_step`` after
the optimizer step's last backward, before clipping. This module adds what is GRPO-specific:

- **Layout**: the policy sees ``(B, P + C)`` (left-padded prompts, right-padded completions), and
  the watched modules' activations have that shape, so the block uses it: position p scores token
  p + 1, completion token j is scored at position ``P - 1 + j``, the loss mask is TRL's
  ``completion_mask`` (× ``tool_mask``) moved there. TRL's fused LM head computes the log-probs
  without calling ``lm_head`` as a module (its hook never fires): :mod:`gradloc.integrations.fused_head`
  scores the head in closed form from the log-probs' gradient (within a factor √2).
- **RL fields**: ``_get_per_token_logps_and_entropies`` is overridden to keep detached copies of
  the log-probs and entropies the loss computes (the loss keeps the ones with grad); with the batch's
  ``old_per_token_logps`` (present only when TRL computes them), ``sampling_per_token_logps`` (vLLM)
  and ``advantages`` they become ``mon.rl_fields(...)``. ``ratio`` and ``clipped`` follow TRL's
  formula: r = exp(log π − log π_old) (π_old = π when TRL has no old log-probs; the sequence mean for
  ``importance_sampling_level="sequence"``), clipped = the min took clip(r)·A (the −min(r·A, clip(r)·A)
  loss types only).
- **Sample ids**: TRL has none. When TRL builds a generation batch, each completion gets
  ``"<step>:<prompt>:<k>"`` (the optimizer step that generated it, the prompt's index in that
  generation batch over all processes, the completion's index among its prompt's
  ``num_generations``), or ``"<id>:<k>"`` with ``gradloc_sample_ids="<dataset column>"``. They ride
  in the batch as the list ``gradloc_sample_ids`` (TRL shuffles and splits lists with the tensors).
- **Provenance**: TRL knows no data source nor dataset index; prompt rows carrying ``with_provenance``'s columns
  (HF ``datasets``) give each of their completions that SampleInfo, riding as the list ``gradloc_sample_infos``.
- **Probe**: TRL's own ``_compute_loss`` with the advantages multiplied by the token mask. Every
  loss type's per-token policy term is proportional to its token's advantage, and the masks and
  normalizers (``completion_mask``, ``num_items_in_batch``, GA) are untouched, so the probe is the
  training loss with each per-token term × mask, normalized as the configured ``loss_type`` does
  (dapo, grpo, bnpo, dr_grpo, and cispo, sapo, luspo, vespo alike). The KL term (β ≠ 0) is masked
  by setting the reference log-prob of a dropped token to its policy log-prob (its KL term and
  gradient are then 0). During a probe, ``_metrics`` is swapped for a scratch dict (probes never
  reach the logged metrics), the adaptive-entropy controller's state is restored afterwards, and
  the accelerator's gather/reduce are local (a probe runs on one rank; collectives would hang).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("gradloc.integrations.trl needs the 'trl' extra: pip install 'gradloc[trl]'") from exc

from gradloc.errors import BatchMetadataError
from gradloc.integrations.fused_head import FusedHeadScores
from gradloc.integrations.provenance import SAMPLE_INFOS, rows_sample_infos
from gradloc.integrations.transformers import GradlocTrainerMixin, _pad_id

log = logging.getLogger("gradloc")
SAMPLE_IDS = "gradloc_sample_ids"  # the generated batch's list of derived sample ids
CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # per-token loss −min(r·A, clip(r)·A)
_CONTROLLER = ("entropy_coef", "_entropy_window_stats", "_last_world_entropy")  # adaptive-entropy state


class GradlocGRPOMixin(GradlocTrainerMixin):
    """Attach gradloc to ``trl.GRPOTrainer`` or a subclass of it: list it first among the bases.

    Arguments as :class:`~gradloc.integrations.transformers.GradlocTrainerMixin`; here
    ``gradloc_sample_ids`` names a dataset column identifying the prompt (sample ids become
    ``"<id>:<k>"``, k the completion's index among the prompt's generations).
    """

    _gradloc_logps: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (log π, entropy) (B, C), detached
    _gradloc_capturing = False  # inside compute_loss of a training micro-batch with per-token statistics
    _gradloc_probe: "_ProbeMask | None" = None
    _gradloc_head: FusedHeadScores | None = None  # scores TRL's fused LM head (never called as a module)
    _gradloc_controller: dict[str, Any] | None = None  # adaptive-entropy state the step's losses saw

    # -- the generated batch ----------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: Any) -> Any:
        out = super()._generate_and_score_completions(inputs)
        if self.gradloc_config is not None and self.model.training and isinstance(out, dict):
            out[SAMPLE_IDS] = self._gradloc_derive_ids(inputs)
            blocks = self._gradloc_blocks  # the prompt rows' with_provenance columns, one per completion
            infos = rows_sample_infos([row if isinstance(row, Mapping) else {} for row in inputs],
                                      blocks.drop_provenance if blocks is not None else None)
            if infos is not None:
                out[SAMPLE_INFOS] = infos
        return out

    def _gradloc_derive_ids(self, rows: Any) -> list[str]:
        """One id per completion of the local generation batch (row i = prompt (first + i) // G)."""
        n, g = len(rows), self.num_generations
        first = self.accelerator.process_index * n  # TRL groups completions over the gathered batch
        col, step = self.gradloc_sample_id_column, self.state.global_step
        ids = []
        for i, row in enumerate(rows):
            prompt, k = divmod(first + i, g)
            own = row.get(col) if col is not None and isinstance(row, Mapping) else None
            ids.append(f"{own}:{k}" if own is not None else f"{step}:{prompt}:{k}")
        return ids

    def _gradloc_pop_ids(self, inputs: Any) -> tuple[Any, list[str] | None]:
        return inputs, None  # raw prompt rows: the ids are derived with the generated batch

    def _gradloc_attach(self, model: torch.nn.Module, inputs: Any) -> None:
        super()._gradloc_attach(model, inputs)
        if self.gradloc.hooks is not None:
            self._gradloc_head = FusedHeadScores(self.accelerator.unwrap_model(model), self.gradloc.hooks,
                                                 self.temperature, self.gradloc.note_event)

    def _gradloc_close(self) -> None:
        if self._gradloc_head is not None:
            self._gradloc_head.close()
            self._gradloc_head = None
        super()._gradloc_close()

    def _gradloc_degrade_reason(self, inputs: Any) -> str | None:
        if self.args.torch_compile:
            return "torch_compile=True (per-token hooks do not run inside a compiled graph)"
        return None

    def _gradloc_micro_batch_args(self, inputs: Mapping[str, Any], ids: list[str] | None,
                                  index: int) -> dict[str, Any]:
        """The policy's (B, P + C) layout: position p scores token p + 1."""
        prompt, completion = _need(inputs, "prompt_ids"), _need(inputs, "completion_ids")
        if prompt.dim() != 2 or completion.dim() != 2 or prompt.shape[0] != completion.shape[0]:
            raise BatchMetadataError(f"prompt_ids {tuple(prompt.shape)} and completion_ids {tuple(completion.shape)} "
                                     "must be (B, P) and (B, C)")
        if prompt.shape[1] == 0:
            raise BatchMetadataError("empty prompts: no position scores the first completion token")
        seq = torch.cat([prompt, completion], dim=1)  # (B, P + C): the policy's input
        token_ids = F.pad(seq[:, 1:], (0, 1), value=_pad_id(self.processing_class))  # (B, P + C)
        loss_mask = _positions(_loss_mask(inputs).bool(), prompt.shape[1], False)
        ids = ids or inputs.get(SAMPLE_IDS)
        if ids is None:
            ids = [f"{self.state.global_step}:{index}:{row}" for row in range(seq.shape[0])]
        infos = inputs.get(SAMPLE_INFOS)
        return dict(token_ids=token_ids, loss_mask=loss_mask, sample_ids=list(ids),
                    **({"sample_infos": list(infos)} if infos is not None else {}))

    # -- RL fields ----------------------------------------------------------------------------------
    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        block = self._gradloc_block
        if block is None or not block.entered or self.gradloc.hooks is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self._gradloc_capturing, self._gradloc_logps = True, None
        if not self._gradloc_parts:  # the step's first micro-batch: the controller updates after its last
            self._gradloc_controller = {name: getattr(self, name) for name in _CONTROLLER if hasattr(self, name)}
        if self._gradloc_head is not None:
            self._gradloc_head.arm(True)
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._gradloc_capturing = False
            if self._gradloc_head is not None:
                self._gradloc_head.arm(False)
        self._gradloc_give_rl_fields(inputs, block.setup)
        return loss

    def _get_per_token_logps_and_entropies(self, model: torch.nn.Module, input_ids: torch.Tensor,
                                           attention_mask: torch.Tensor, logits_to_keep: int, *args: Any,
                                           **kwargs: Any) -> Any:
        logps, entropies, *rest = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if torch.is_grad_enabled():
            if self._gradloc_capturing:
                self._gradloc_logps = (logps.detach(), None if entropies is None else entropies.detach())
                if self._gradloc_head is not None:  # completion token j is scored at position P - 1 + j
                    self._gradloc_head.on_logps(logps, entropies, input_ids.shape[1] - logits_to_keep - 1)
            if self._gradloc_probe is not None:
                entropies = self._gradloc_probe.apply(logps, entropies)
        return (logps, entropies, *rest)

    def _gradloc_give_rl_fields(self, inputs: Mapping[str, Any], setup: bool) -> None:
        got, self._gradloc_logps = self._gradloc_logps, None
        if got is None:
            return  # a _compute_loss override that never asked for the policy's log-probs
        try:
            fields = self._gradloc_rl_values(inputs, *got)
        except Exception as exc:  # never raise into the training loop after setup
            if setup:
                raise BatchMetadataError(f"the GRPO batch's RL fields could not be built: {exc}") from exc
            self.gradloc.note_event("integration_rl_fields_errors")
            log.warning("gradloc: RL fields of step %d left out", self.state.global_step, exc_info=True)
            return
        self.gradloc.rl_fields(**fields)  # typed error at setup, counted and dropped after

    def _gradloc_rl_values(self, inputs: Mapping[str, Any], logp: torch.Tensor,
                           entropy: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
        """Each field in the block's (B, P + C) layout (NaN off the completion); advantages (B,)."""
        P = inputs["prompt_ids"].shape[1]
        old, rollout = inputs.get("old_per_token_logps"), inputs.get("sampling_per_token_logps")
        adv = inputs["advantages"]
        adv_tok = adv[:, None] if adv.dim() == 1 else adv  # (B,) -> (B, 1), or (B, C)
        log_ratio = logp - (logp if old is None else old)  # (B, C): TRL's π_old is π itself without old log-probs
        if self.importance_sampling_level == "sequence":
            mask = _loss_mask(inputs).to(logp.dtype)
            seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
            log_ratio = seq[:, None].expand_as(logp)  # (B,) -> (B, C)
        ratio = torch.exp(log_ratio)
        clipped = None
        if self.loss_type in CLIP_LOSSES:
            upper = ratio if self.args.delta is None else ratio.clamp(max=self.args.delta)
            clipped = ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high) * adv_tok < upper * adv_tok
        return dict(logp=_positions(logp, P), old_logp=_positions(old, P), rollout_logp=_positions(rollout, P),
                    advantages=adv if adv.dim() == 1 else _positions(adv, P), ratio=_positions(ratio, P),
                    clipped=_positions(clipped, P, False), entropy=_positions(entropy, P))

    # -- the probe --------------------------------------------------------------------------------
    def gradloc_probe_loss(self, model: torch.nn.Module, inputs: Mapping[str, Any], token_mask: torch.Tensor,
                           num_items_in_batch: Any, ga_steps: int) -> torch.Tensor:
        """TRL's ``_compute_loss`` with only ``token_mask``'s per-token terms, scaled as training.

        ``token_mask`` is in the block's (B, P + C) layout. The advantages are multiplied by it
        (every loss type's policy term is ∝ A), the KL reference of a dropped token is its policy
        log-prob, and with an entropy bonus the entropies are multiplied by it too; masks and
        normalizers stay as in training, so the loss type's normalization is kept. The MoE router
        loss is not per-token and is left out. ``_compute_loss`` already divides by GA
        (``loss_is_scaled_for_ga``); like ``training_step``, the result is ÷ the accelerator's own
        GA steps (1 under the Trainer).
        """
        P, C = inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]
        adv = inputs["advantages"]
        keep = token_mask.to(device=adv.device)[:, P - 1:P + C - 1]  # (B, P + C) -> (B, C)
        masked = dict(inputs)
        masked["advantages"] = (adv[:, None] if adv.dim() == 1 else adv) * keep.to(adv.dtype)  # (B, C)
        with self._gradloc_probe_scope(_ProbeMask(masked, keep, self)):
            with self.compute_loss_context_manager():
                loss = self._compute_loss(model, masked)
        return loss / self.accelerator.gradient_accumulation_steps

    @contextmanager
    def _gradloc_probe_scope(self, probe: "_ProbeMask") -> Iterator[None]:
        """Side effects of ``_compute_loss`` kept out of training: metrics, collectives, controller
        state (the adaptive entropy coefficient is set back to what the step's losses applied)."""
        saved = {name: getattr(self, name) for name in _CONTROLLER if hasattr(self, name)}
        for name, value in (self._gradloc_controller or {}).items():
            setattr(self, name, value)  # the coefficient the step's losses applied, not its update
        metrics, accelerator, aux = self._metrics, self.accelerator, getattr(self, "aux_loss_enabled", False)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.accelerator = _LocalAccelerator(accelerator)
        self.aux_loss_enabled, self._gradloc_probe = False, probe
        try:
            yield
        finally:
            self._metrics, self.accelerator, self.aux_loss_enabled, self._gradloc_probe = metrics, accelerator, aux, None
            for name, value in saved.items():
                setattr(self, name, value)


class _ProbeMask:
    """What a probe masks beyond the advantages, applied where the loss computes the log-probs."""

    def __init__(self, inputs: dict[str, Any], keep: torch.Tensor, trainer: Any) -> None:
        self.inputs, self.keep = inputs, keep.bool()  # (B, C)
        self.kl = trainer.beta != 0.0 and inputs.get("ref_per_token_logps") is not None
        # the entropy bonus is linear in each token's entropy; with a top-entropy mask the entropies
        # also pick the trained tokens, so only their gradient is masked there (values unchanged)
        bonus = getattr(trainer, "_entropy_bonus_enabled", False)
        self.entropy_values = bonus and trainer.top_entropy_quantile == 1.0

    def apply(self, logps: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor | None:
        if self.kl:  # KL(ref = π) = 0 with zero gradient: the dropped token's KL term is gone
            self.inputs["ref_per_token_logps"] = torch.where(self.keep, self.inputs["ref_per_token_logps"],
                                                             logps.detach())
        if entropies is None:
            return None
        if self.entropy_values:
            return entropies * self.keep
        return torch.where(self.keep, entropies, entropies.detach())


class _LocalAccelerator:
    """The trainer's accelerator with collectives made local: a probe runs on one rank only."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @staticmethod
    def gather(tensor: Any) -> Any:
        return tensor

    @staticmethod
    def gather_for_metrics(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    @staticmethod
    def reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor


class GradlocGRPOTrainer(GradlocGRPOMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with gradloc attached: ``GradlocGRPOTrainer(..., gradloc=dict(job="grpo"))``."""


def _need(inputs: Mapping[str, Any], key: str) -> torch.Tensor:
    value = inputs.get(key)
    if not isinstance(value, torch.Tensor):
        raise BatchMetadataError(f"the GRPO micro-batch has no {key!r} tensor")
    return value


def _loss_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
    """(B, C) the completion tokens with a loss term, as TRL's ``_compute_loss`` masks them."""
    mask = _need(inputs, "completion_mask")
    tool = inputs.get("tool_mask")
    return mask if tool is None else mask * tool


def _positions(x: torch.Tensor | None, prompt_len: int, fill: float | bool = float("nan")) -> torch.Tensor | None:
    """(B, C) per completion token -> (B, P + C) per loss position: token j is scored at P - 1 + j."""
    if x is None:
        return None
    B, C = x.shape
    out = x.new_full((B, prompt_len + C), fill)  # (B, P + C)
    out[:, prompt_len - 1:prompt_len + C - 1] = x
    return out
