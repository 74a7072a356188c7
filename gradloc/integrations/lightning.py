"""gradloc for PyTorch Lightning: one callback.

    trainer = L.Trainer(callbacks=[GradlocCallback(job="sft")], accumulate_grad_batches=2,
                        gradient_clip_val=1.0, precision="bf16-mixed")

    class MyModule(L.LightningModule):             # two optional methods
        def gradloc_token_loss(self, batch):        # the probe hook: per-token loss terms (B, T)
            return causal_lm_token_loss(self.model(input_ids=batch["input_ids"]).logits, batch["labels"])
        def gradloc_batch(self, batch):             # token ids; default: an HF batch's shifted labels
            return dict(token_ids=..., loss_mask=..., sample_ids=...)

Where each stage runs (Lightning 2.6, automatic optimization; DESIGN.md §8): ``on_train_batch_start``
sees every micro-batch before its forward (the block opens), ``on_before_backward`` its loss (already
divided by ``accumulate_grad_batches``), ``on_after_backward`` follows its backward (the block closes),
and ``on_before_optimizer_step`` runs once per optimizer step with the fully accumulated gradient,
before Lightning clips it: ``end_step`` runs there, and so do the probes (inside ``optimizer.step``'s
closure, before the update; gradloc restores the gradients). A probe's loss is
``sum(gradloc_token_loss(batch) · mask) / accumulate_grad_batches`` under the precision plugin's
autocast. Under ``strategy="ddp"`` the callback watches the ``DistributedDataParallel`` wrapper: a DDP
job (spikes judged on the job's gradient, probes in ``no_sync``, one incident naming the rank).

What it cannot serve, it says once at ``on_fit_start``, and training goes on: manual optimization (the
module clips and steps itself, so no point sees the unclipped step gradient with its micro-batches:
per-layer statistics of the gradient ``opt.step()`` sees), a strategy other than single-device and DDP
(per-layer statistics of the strategy's model if gradloc can read it, else gradloc off for the fit; only
single-device and DDP are tested), DeepSpeed (it accumulates, clips and steps inside its engine: gradloc off),
no ``gradloc_token_loss`` (per-token attribution without probes: nothing is called located).

Provenance: a batch from :class:`~gradloc.integrations.provenance.ProvenanceCollator` (or with the provenance
columns collated into lists) loses it in ``on_train_batch_start`` — in place, before ``training_step`` sees the
batch — and its micro-batch carries one SampleInfo per row (validation, test and predict batches lose it too).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Mapping

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("gradloc.integrations.lightning needs the 'lightning' extra: pip install 'gradloc[lightning]'") from exc

from gradloc.adapters.pytorch import watch
from gradloc.config import WatchConfig
from gradloc.errors import ConfigError, GradlocError
from gradloc.integrations.hf_batch import causal_lm_token_loss
from gradloc.integrations.loop import LoopDriver, as_config, hf_view
from gradloc.integrations.provenance import take_sample_infos

log = logging.getLogger("gradloc")
__all__ = ["GradlocCallback", "causal_lm_token_loss"]


class GradlocCallback(pl.Callback):
    """Attach gradloc to a ``lightning.pytorch.Trainer``. ``config``: a :class:`WatchConfig` or a dict of its
    fields; keyword ``overrides`` are WatchConfig fields too (``job=``, ``token_stats=``…). ``decode``:
    token ids → text for the incident page (a tokenizer or its ``decode``)."""

    def __init__(self, config: WatchConfig | Mapping[str, Any] | None = None, *, decode: Any = None,
                 sinks: tuple[Any, ...] = (), **overrides: Any) -> None:
        cfg = as_config(config)  # a bad config fails here, before the Trainer runs anything
        if cfg is None:
            raise ConfigError("GradlocCallback(config=False): to train without gradloc, leave the callback out")
        self.config = replace(cfg, **overrides) if overrides else cfg
        self.decode, self.sinks = decode, tuple(sinks)
        self.driver: LoopDriver | None = None  # while fitting
        self.monitor: Any = None  # the last fit's monitor (closed when the fit ends)
        self.degraded: str | None = None  # why gradloc runs with less than its full path, if it does
        self._plan: tuple[Any, WatchConfig, bool] | None = None  # (what to watch, config, full path), at on_fit_start

    # -- fit ----------------------------------------------------------------------------------
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.monitor, self.degraded = None, None
        cfg = self.config
        target, reason = _target(trainer, pl_module)
        if target is None:
            self._say(f"{reason}; gradloc is off for this fit")
            return
        if reason is None and not pl_module.automatic_optimization:
            reason = ("manual optimization: the module clips and steps itself, so gradloc cannot see the step's "
                      "unclipped gradient with its micro-batches")
        if reason is not None:
            cfg = replace(cfg, token_stats=False)
        elif cfg.token_stats and not callable(getattr(pl_module, "gradloc_token_loss", None)):
            self._say(f"{type(pl_module).__name__} has no gradloc_token_loss(batch) (the probe hook): per-token "
                      "attribution without probes, so culprits are not verified")
        if reason is not None:
            self._say(f"{reason}; per-layer statistics only")
        self._plan = (target, cfg, reason is None)

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self._plan is not None:
            self._attach(trainer, pl_module)
        driver = self.driver
        # the batch's provenance (ProvenanceCollator's key or collated columns) leaves the batch here, always:
        # training_step gets this same object, and a leftover key would reach model(**batch)
        infos = driver.take_infos(batch) if driver is not None else take_sample_infos(batch)
        if driver is not None and pl_module.automatic_optimization:
            driver.begin(batch, infos)

    def on_validation_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                                  *args: Any) -> None:
        take_sample_infos(batch)  # a loader with the provenance collator: the model must not see its key

    on_test_batch_start = on_predict_batch_start = on_validation_batch_start

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Any) -> None:
        if self.driver is not None:
            self.driver.add_loss(loss)

    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.driver is not None:
            self.driver.end_micro_batch()

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        driver = self.driver
        if driver is None:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            driver.divide_loss(scaler.get_scale())  # on_before_backward saw the loss GradScaler scaled
        driver.end_step(scaler=scaler, step=trainer.global_step)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        if self.driver is not None and self.driver.block_open:  # training_step returned None: no backward
            self.driver.end_micro_batch(failed=True)

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._close()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._close()

    # -- internals ----------------------------------------------------------------------------
    def _attach(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """On the first batch (every rank together): the optimizer exists and the strategy has wrapped the model."""
        (target, cfg, full), self._plan = self._plan, None
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        decode = getattr(self.decode, "decode", self.decode)
        try:
            mon = watch(target, optimizer, config=cfg, decode=decode, sinks=self.sinks)
        except Exception as exc:
            if full and isinstance(exc, GradlocError):  # on the full path: a setup mistake the user must see
                raise
            self._say(f"gradloc is off for this fit: {exc}")
            return
        self.monitor = mon
        token_loss = getattr(pl_module, "gradloc_token_loss", None)
        view = getattr(pl_module, "gradloc_batch", None) or hf_view
        self.driver = LoopDriver(mon, "lightning", view, token_loss if callable(token_loss) else None,
                                 divisor=lambda: float(trainer.accumulate_grad_batches),
                                 context=trainer.precision_plugin.forward_context, strict=full)

    def _close(self) -> None:
        driver, self.driver, self._plan = self.driver, None, None
        if driver is not None:
            driver.close()

    def _say(self, message: str) -> None:
        self.degraded = message if self.degraded is None else f"{self.degraded}; {message}"
        log.warning("gradloc (lightning): %s", message)


def _target(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> tuple[Any, str | None]:
    """What gradloc watches (None: nothing), and why it cannot take its full path there (None: it can)."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        return None, ("DeepSpeedStrategy: DeepSpeed accumulates, clips and steps inside its engine, so no callback "
                      "point sees the step's gradient before them; use gradloc.watch(engine) in a DeepSpeed loop")
    if isinstance(strategy, DDPStrategy):
        return strategy.model, None  # the DistributedDataParallel wrapper: a DDP job
    if isinstance(strategy, SingleDeviceStrategy):
        return pl_module, None
    return strategy.model or pl_module, (f"{type(strategy).__name__} is not a strategy gradloc's Lightning callback "
                                         "knows (single-device and DDP are)")
