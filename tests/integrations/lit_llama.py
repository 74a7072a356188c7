"""The LightningModule the Lightning tests train (tests/integrations/test_lightning.py in one process,
tests/integrations/distributed/lightning_job.py on every DDP rank): the tiny pre-trained HF Llama of tests/tiny_llama.py,
its own HF loss in ``training_step``, and gradloc's two optional methods: ``gradloc_token_loss`` (the probe
hook: the HF loss's per-token terms) and ``gradloc_batch`` (the shifted labels, and the rows' uids)."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from gradloc.integrations.lightning import causal_lm_token_loss
from gradloc.integrations.loop import hf_view
from tests.tiny_llama import World, causal_lm


class LitLlama(pl.LightningModule):
    def __init__(self, w: World, probe_hook: bool = True, manual: bool = False) -> None:
        super().__init__()
        self.model = causal_lm(w)
        if not probe_hook:
            self.gradloc_token_loss = None  # a module without the probe hook
        self.automatic_optimization = not manual

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0)
        opt.step()
        opt.zero_grad()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def gradloc_batch(self, batch: dict) -> dict[str, Any]:
        return {**hf_view(batch), "sample_ids": [str(u) for u in batch["uid"].tolist()]}

    def gradloc_token_loss(self, batch: dict) -> torch.Tensor:
        return causal_lm_token_loss(self.model(input_ids=batch["input_ids"]).logits, batch["labels"])


def fit(module: LitLlama, rows: list[dict], batch: int, callbacks: list, sampler: Any = None,
        **trainer_kw: Any) -> pl.Trainer:
    """Train ``module`` on ``rows`` in order (no shuffle, or ``sampler``'s order), quietly, with the given
    Trainer settings."""
    loader = torch.utils.data.DataLoader(rows, batch_size=batch, shuffle=False, sampler=sampler)
    base = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    base.update(trainer_kw)
    trainer = pl.Trainer(**base)
    trainer.fit(module, loader)
    return trainer
