"""gradloc for the Hugging Face ``Trainer``: ``GradlocTrainer``, or ``GradlocTrainerMixin`` for a subclass.

    trainer = GradlocTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                             gradloc=dict(job="sft-7b"))      # WatchConfig fields, or a WatchConfig
    trainer.train()
    trainer.gradloc.incidents

    class MySFTTrainer(GradlocTrainerMixin, SFTTrainer): ...  # the mixin goes first

Why a subclass and not a ``TrainerCallback``: gradloc needs (a) every micro-batch's token ids
around its forward and backward, and (b) to run after the last micro-batch's backward and before
gradient clipping. Callbacks never receive the inputs, and no callback fires in that window: the
loop (``Trainer._run_epoch`` in transformers 5.23) calls ``training_step`` per micro-batch, then on
the step's last one ``_clip_grad_norm`` and only then ``on_pre_optimizer_step`` (which sees
clipped gradients).

The mechanism: ``training_step(model, inputs, num_items_in_batch)`` is overridden. Each call runs
the Trainer's own ``training_step`` (``_prepare_inputs``, forward, loss scaling,
``accelerator.backward``) and opens ``mon.micro_batch(...)`` as soon as ``_prepare_inputs`` returns
the batch the loss will see, so the block holds the forward and the backward (a trainer that
generates its batch there, like TRL's GRPOTrainer, builds on this: ``gradloc.integrations.trl``).
Subclasses adapt three methods: ``_gradloc_micro_batch_args`` (the block's layout),
``_gradloc_pop_ids`` (sample ids of the raw batch) and ``gradloc_probe_loss``. The loop sets ``accelerator.sync_gradients`` to its ``do_sync_step``
before each ``training_step``, and clips exactly when that flag is set. So when it is set after our
call returns, this was the last micro-batch of the optimizer step, and ``mon.end_step`` runs then:
after its backward, before clipping. The probe closure recomputes a micro-batch's loss through
``compute_loss`` with labels outside the token mask set to -100, scaled as ``training_step`` scales
it (see :meth:`GradlocTrainerMixin.gradloc_probe_loss`).
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch

try:
    import transformers
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("gradloc.integrations.transformers needs the 'hf' extra: pip install 'gradloc[hf]'") from exc

from gradloc.adapters.pytorch import Monitor, watch
from gradloc.config import WatchConfig
from gradloc.errors import BatchMetadataError, UnsupportedModelError
from gradloc.integrations.held import HeldBlocks
from gradloc.integrations.hf_batch import batch_shape, causal_view, mask_labels, pop_sample_ids
from gradloc.integrations.loop import as_config
from gradloc.integrations.provenance import pop_sample_infos, provenance_columns
from gradloc.parallel.job import uncompiled

log = logging.getLogger("gradloc")


@dataclass
class _Part:
    """One micro-batch of the current optimizer step, kept until ``end_step`` for the probes."""

    inputs: Mapping[str, Any]  # as the loss saw them (after _prepare_inputs), shallow copy
    num_items_in_batch: Any
    ga_steps: int  # the Trainer's current_gradient_accumulation_steps for this micro-batch


@dataclass
class _Block:
    """The micro-batch being run: its gradloc block opens once the Trainer has prepared its inputs
    (``_prepare_inputs``, which a trainer such as TRL's GRPOTrainer uses to generate them)."""

    ids: list[str] | None  # sample ids popped from the raw batch, if any
    infos: list[Any] | None  # one SampleInfo per row, popped from the batch (integrations/provenance.py)
    setup: bool  # before the monitor's first end_step: bad metadata raises
    num_items_in_batch: Any
    ga_steps: int
    prepared: Mapping[str, Any] | None = None  # as the loss sees them, shallow copy
    entered: bool = False  # the block is open (False: left out of per-token statistics, counted)


class GradlocTrainerMixin:
    """Attach gradloc to any ``transformers.Trainer`` subclass: list it first among the bases.

    ``gradloc``: a :class:`WatchConfig`, a dict of its fields (a nested config — ``detector``, ``localizer``,
    ``precursors`` and its ``drift`` — may be a dict too), ``None`` for the defaults, or ``False`` to train without gradloc.
    ``gradloc_sample_ids``: the batch column holding sample ids. Named here, it survives the
    Trainer's ``remove_unused_columns``; it must collate to a tensor or a list. Without it, a
    ``uid`` or ``id`` key present in the batch is used, else ``"<step>:<micro-batch>:<row>"``.
    """

    def __init__(self, *args: Any, gradloc: WatchConfig | Mapping[str, Any] | bool | None = None,
                 gradloc_sample_ids: str | None = None, gradloc_sinks: Sequence[Any] = (), **kwargs: Any) -> None:
        self.gradloc_config = as_config(gradloc)  # a bad config fails here, before the Trainer builds anything
        self.gradloc_sample_id_column = gradloc_sample_ids
        self.gradloc_sinks = tuple(gradloc_sinks)
        self.gradloc: Monitor | None = None  # the last train()'s monitor (closed after train returns)
        self.gradloc_degraded: str | None = None  # why per-token statistics are off, if they are
        self._gradloc_blocks: HeldBlocks | None = None  # the micro-batch/step driver of the current monitor
        self._gradloc_block: _Block | None = None  # set only inside training_step
        self._gradloc_forward_args: frozenset[str] | None = None  # the model's forward parameters
        super().__init__(*args, **kwargs)

    # -- Trainer overrides ------------------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        self.gradloc, self.gradloc_degraded, self._gradloc_blocks = None, None, None  # attached on the first step
        try:
            return super().train(*args, **kwargs)
        finally:
            self._gradloc_close()

    @property
    def gradloc_errors(self) -> int:
        """gradloc failures caught on the training path (each one logged and counted)."""
        return self._gradloc_blocks.errors if self._gradloc_blocks is not None else 0

    @property
    def _gradloc_parts(self) -> list[_Part]:
        """The current optimizer step's micro-batches, kept for the probes (the driver's payloads)."""
        return self._gradloc_blocks.payloads if self._gradloc_blocks is not None else []

    @property
    def _gradloc_loss(self) -> torch.Tensor | None:
        """The current optimizer step's summed micro-batch losses so far (detached)."""
        return self._gradloc_blocks.loss if self._gradloc_blocks is not None else None

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        if self.gradloc_config is None:
            return super().training_step(model, inputs, num_items_in_batch)
        if self.gradloc is None:
            self._gradloc_attach(model, inputs)  # typed errors only here, before the first optimizer step
        blocks = self._gradloc_blocks
        inputs, ids = self._gradloc_pop_ids(inputs)
        inputs, infos = pop_sample_infos(inputs, blocks.drop_provenance) if isinstance(inputs, Mapping) else (inputs, None)
        block = self._gradloc_block = _Block(ids, infos, not blocks.stepped, num_items_in_batch,
                                             self._gradloc_ga_steps())
        try:  # _prepare_inputs opens the micro-batch block inside it: it holds the forward and the backward
            loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException as exc:
            blocks.close(exc)  # the monitor drops the micro-batch
            raise
        finally:
            self._gradloc_block = None
        blocks.close()
        if block.prepared is None:  # a training_step override that never prepared its inputs
            blocks.skip(f"micro-batch {len(blocks.payloads)} of step {self.state.global_step}: its inputs were "
                        "never prepared (left out of per-token statistics)")
        blocks.add_loss(loss)
        if self.accelerator.sync_gradients:  # the loop clips right after this call returns
            self._gradloc_end_step(model)
        return loss

    def _prepare_inputs(self, inputs: Any) -> Any:
        prepared = super()._prepare_inputs(inputs)
        block = self._gradloc_block
        if block is not None and block.prepared is None and isinstance(prepared, Mapping):
            block.prepared = dict(prepared)  # compute_loss may pop "labels" from its dict
            block.entered = self._gradloc_open(block, prepared)
        return prepared

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if self.gradloc_sample_id_column is not None:
            inputs = self._gradloc_pop_ids(inputs)[0]
        if isinstance(inputs, Mapping):
            inputs = pop_sample_infos(inputs)[0]
        return super().prediction_step(model, inputs, *args, **kwargs)

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        if self._signature_columns is None:
            return
        keep = [self.gradloc_sample_id_column] if self.gradloc_sample_id_column is not None else []
        keep += provenance_columns(getattr(self.train_dataset, "column_names", None) or [])  # with_provenance's
        self._signature_columns = [*self._signature_columns, *(c for c in keep if c not in self._signature_columns)]

    # -- the probe --------------------------------------------------------------------------------
    def gradloc_probe_loss(self, model: torch.nn.Module, inputs: Mapping[str, Any], token_mask: torch.Tensor,
                           num_items_in_batch: Any, ga_steps: int) -> torch.Tensor:
        """Micro-batch loss with only ``token_mask``'s terms, scaled as ``Trainer.training_step`` scales it.

        Labels outside the mask become -100. With ``num_items_in_batch`` (a token sum divided by the
        step's label count) that drops exactly those terms. Without it the loss is a mean over the
        micro-batch's own labels, so it is rescaled by kept/total. Then, like ``training_step``: the
        mean over GPUs of DataParallel, ÷ GA steps unless the loss is already scaled for GA, ÷ the
        accelerator's own GA steps (1 under the Trainer). GradScaler scaling is left out: gradloc
        unscales the stored gradient instead. Override this for a custom ``compute_loss`` whose
        per-token terms are not masked by -100 labels.
        """
        masked, kept, total = mask_labels(inputs, token_mask)
        factor = 1.0
        if num_items_in_batch is None and kept < total:
            factor = kept / total if kept else 0.0
            if kept == 0:
                masked = dict(inputs)  # a mean over no labels is NaN: the full loss × 0 has the zero gradient
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, masked, num_items_in_batch=num_items_in_batch)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        if factor != 1.0:
            loss = loss * factor
        if not self._gradloc_loss_is_scaled_for_ga(num_items_in_batch):
            loss = loss / ga_steps
        return loss / self.accelerator.gradient_accumulation_steps

    def _gradloc_ga_steps(self) -> int:
        """The divisor training_step uses: fewer than GA for a short last step of an epoch."""
        return int(getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps))

    def _gradloc_loss_is_scaled_for_ga(self, num_items_in_batch: Any) -> bool:
        explicit = getattr(self, "loss_is_scaled_for_ga", None)  # transformers >= 5: a subclass may declare it
        if explicit is not None:
            return bool(explicit)
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    # -- internals --------------------------------------------------------------------------------
    def _gradloc_attach(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> None:
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise UnsupportedModelError(
                "DeepSpeed clips and steps inside accelerator.backward, so no point between the last backward "
                "and clipping exists in the Trainer; train without gradloc= or use gradloc.watch in your own loop")
        cfg = self.gradloc_config
        reason = self._gradloc_degrade_reason(inputs)
        if reason is not None and cfg.token_stats:
            log.warning("gradloc: per-token statistics are off: %s; per-layer statistics and spike detection "
                        "still run", reason)
            cfg, self.gradloc_degraded = replace(cfg, token_stats=False), reason
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer inside accelerate's wrapper
        tok = self.processing_class
        decode = getattr(tok, "decode", None) or getattr(getattr(tok, "tokenizer", None), "decode", None)
        self.gradloc = watch(self._gradloc_job_model(model), opt, config=cfg, decode=decode,
                             sinks=self.gradloc_sinks)
        self._gradloc_blocks = HeldBlocks(self.gradloc, "hf")

    def _gradloc_job_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """What gradloc watches: the job the Trainer trains. Under multi-process DDP that is the
        ``DistributedDataParallel`` wrapper itself (under a compile wrapper too), which gradloc makes a DDP
        job: spikes judged on the job's gradient, probes in ``no_sync`` combined over the ranks, one incident
        naming the rank. Anything else: the model under accelerate's wrappers."""
        from torch.nn.parallel import DistributedDataParallel

        inner = uncompiled(model)
        return inner if isinstance(inner, DistributedDataParallel) else self.accelerator.unwrap_model(model)

    def _gradloc_degrade_reason(self, inputs: Mapping[str, Any]) -> str | None:
        if causal_view(inputs) is None:
            return "the batch has no 2-D integer labels (per-token statistics need the token each position scores)"
        if not self._gradloc_is_causal_lm():
            return (f"{type(self.accelerator.unwrap_model(self.model)).__name__} is not a causal LM whose loss shifts "
                    "the labels (only that layout is supported)")
        return None

    def _gradloc_is_causal_lm(self) -> bool:
        shifts = getattr(self, "_loss_shifts_labels", None)  # set by Trainer.__init__ in transformers 5
        if shifts is not None:
            return bool(shifts)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model = self.accelerator.unwrap_model(self.model)
        model = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper
        return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()

    def _gradloc_pop_ids(self, inputs: Any) -> tuple[Any, list[str] | None]:
        """The raw batch without its sample-id column (the model never sees it), and the ids."""
        return pop_sample_ids(inputs, self._gradloc_id_columns())

    def _gradloc_id_columns(self) -> list[str]:
        cols = [self.gradloc_sample_id_column] if self.gradloc_sample_id_column else ["uid", "id"]
        if self._gradloc_forward_args is None:
            model = self.accelerator.unwrap_model(self.model)
            self._gradloc_forward_args = frozenset(inspect.signature(model.forward).parameters)
        return [c for c in cols if c not in self._gradloc_forward_args]  # never take an input the model reads

    def _gradloc_open(self, block: _Block, prepared: Mapping[str, Any]) -> bool:
        """Open this micro-batch's block (through the driver: bad metadata raises during setup, is counted after);
        False when it was left out."""
        mon, blocks = self.gradloc, self._gradloc_blocks
        index = len(blocks.payloads)
        if mon.hooks is None:  # per-layer only: the block counts the micro-batch, no probe needs it
            blocks.open(lambda: dict(shape=batch_shape(prepared), sample_ids=block.ids, sample_infos=block.infos))
        else:
            blocks.open(lambda: {"sample_infos": block.infos,  # unless the layout has its own (TRL's generated rows)
                                 **self._gradloc_micro_batch_args(prepared, block.ids, index)},
                        payload=_Part(block.prepared, block.num_items_in_batch, block.ga_steps))
        return blocks.held

    def _gradloc_micro_batch_args(self, inputs: Mapping[str, Any], ids: list[str] | None,
                                  index: int) -> dict[str, Any]:
        """``Monitor.micro_batch`` arguments for a prepared micro-batch: the logits' (B, T) layout,
        where position p scores ``labels[p + 1]``; raises :class:`BatchMetadataError`."""
        view = causal_view(inputs, _pad_id(self.processing_class))
        if view is None:
            raise BatchMetadataError("this micro-batch has no 2-D integer labels")
        if ids is None:
            ids = [f"{self.state.global_step}:{index}:{row}" for row in range(view.token_ids.shape[0])]
        return dict(token_ids=view.token_ids, loss_mask=view.loss_mask, sample_ids=ids)

    def _gradloc_end_step(self, model: torch.nn.Module) -> None:
        probe_for = None
        if self.gradloc.hooks is not None:
            # the module under DDP: a probe's forward must not broadcast buffers (DDP's forward does, a collective
            # the other ranks are not in: only the rank holding the candidates probes); gradloc runs it in no_sync
            probe_model = self.accelerator.unwrap_model(model)

            def probe_for(parts: list[_Part]) -> Any:
                def probe(i: int, token_mask: torch.Tensor) -> torch.Tensor:
                    p = parts[i]
                    return self.gradloc_probe_loss(probe_model, p.inputs, token_mask, p.num_items_in_batch,
                                                   p.ga_steps)
                return probe

        # records carry the Trainer's step numbers (also after a resume)
        self._gradloc_blocks.end_step(probe_for, scaler=self.accelerator.scaler, step=self.state.global_step)

    def _gradloc_close(self) -> None:
        blocks = self._gradloc_blocks
        if blocks is not None:
            blocks.close(RuntimeError("training ended inside the micro-batch"))
            blocks.payloads, blocks.loss = [], None
            blocks.guard(self.gradloc.close, "close", setup_raises=False)


class GradlocTrainer(GradlocTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with gradloc attached: ``GradlocTrainer(..., gradloc=dict(job="sft"))``."""


def _pad_id(tok: Any) -> int:
    tok = getattr(tok, "tokenizer", tok)
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tok, attr, None)
        if isinstance(value, int):
            return value
    return 0
