"""Per-position scores of an LM head that a fused kernel runs without calling the head module.

TRL's trainers (``trl.trainer.utils.add_fused_lm_head``: GRPO, RLOO, SFT, DPO, KTO) patch the
model's forward so that ``model(..., labels=, fused_lm_head=True)`` returns per-token log-probs
from the LM head's weight in chunks, never materializing the logits and never calling
``lm_head`` as a module: its forward hook, and so its per-token rule, never fire.

Closed form used here. With u_t = W a_t the raw logits at position t (a_t the backbone's last
hidden state) and τ the temperature, position t's contribution to ∇W is the rank-1 matrix
(∂L/∂u_t) a_tᵀ with ∂L/∂u_t = (w_t / τ)·(e_y − p_t), where w_t = ∂L/∂log π_t arrives in backward
at the kernel's log-prob output. So its squared Frobenius norm is
(w_t / τ)²·‖e_y − p_t‖²·‖a_t‖², and ‖e_y − p‖² = (1 − p_y)² + Σ_{v≠y} p_v². The kernel returns
neither p nor Σ p²: the score uses the lower bound (1 − p_y)² + max(e^(−H) − p_y², 0) (Σ p² ≥ e^(−H)
by Rényi's inequality; H the entropy when the trainer computes it, else only (1 − p_y)²). Since
Σ_{v≠y} p_v² ≤ (1 − p_y)², the score is between half the exact squared norm and the exact one
(tests/integrations/test_fused_head.py checks this against the materialized logits). Gradient
that reaches the logits through the entropy (an entropy bonus) is not counted.

Unsupported heads (logit soft-capping, a logit scale or multiplier, a bias) are still marked as
called: left unscored, their gradient is reported as the unattributed share, never lost.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from gradloc.collector.token_hooks import TokenHooks

log = logging.getLogger("gradloc")
_SCALES = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


class FusedHeadScores:
    """Scores for the LM head of ``model`` (a ``PreTrainedModel``, or a PEFT wrapper of one)."""

    def __init__(self, model: nn.Module, hooks: TokenHooks, temperature: float = 1.0,
                 note_event: Callable[[str], None] | None = None) -> None:
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.head: nn.Module | None = lm.get_output_embeddings()
        self.hooks = hooks
        self.scale = self._scale(lm, temperature)  # 1/τ, or None: unscored (unattributed)
        self.errors = 0  # kernel calls whose scores failed (each one also a monitor event, "fused_head_errors")
        self._note_event = note_event
        self.armed = False
        self._hidden_sq: torch.Tensor | None = None  # (B, T) ‖a_t‖² of the last armed backbone forward
        self._handle = lm.base_model.register_forward_hook(self._on_backbone) if lm.base_model is not lm else None

    def _scale(self, lm: nn.Module, temperature: float) -> float | None:
        config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        if any(getattr(config, name, None) is not None for name in _SCALES):
            return None
        if self.head is None or getattr(self.head, "bias", None) is not None or temperature <= 0:
            return None
        return 1.0 / temperature

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def arm(self, on: bool) -> None:
        """Capture around the trainer's own loss forward only (not generation, probes or reference models)."""
        self.armed, self._hidden_sq = on, None

    def _on_backbone(self, module: nn.Module, args: tuple, out: Any) -> None:
        if not self.armed or not torch.is_grad_enabled():
            return
        hidden = getattr(out, "last_hidden_state", None)
        if hidden is None and isinstance(out, tuple) and out:
            hidden = out[0]
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            with torch.no_grad():
                self._hidden_sq = hidden.detach().float().pow(2).sum(-1)  # (B, T, D) -> (B, T)

    def on_logps(self, logps: torch.Tensor, entropies: torch.Tensor | None, first: int) -> None:
        """Register the head's score for the kernel's output ``logps`` (B, C), log π of the tokens
        scored at positions ``first … first + C − 1`` of the backbone's (B, T) layout. Never raises."""
        if not self.armed or self.head is None:
            return
        try:
            self._register(logps, entropies, first)
        except Exception:
            self._failed()
            log.warning("gradloc: fused LM head not scored", exc_info=True)

    def _failed(self) -> None:
        self.errors += 1
        if self._note_event is not None:
            self._note_event("fused_head_errors")

    def _register(self, logps: torch.Tensor, entropies: torch.Tensor | None, first: int) -> None:
        add = self.hooks.external(self.head)  # marks the head as called: unscored counts as unattributed
        hidden, scale = self._hidden_sq, self.scale
        if add is None or scale is None or hidden is None or not logps.requires_grad:
            return
        B, C = logps.shape
        if hidden.shape[0] != B or hidden.shape[1] < first + C or first < 0:
            return  # a chunked call: the hidden states seen were another chunk's
        p = logps.detach().float().exp()
        sq = (1 - p).pow(2)  # (B, C) lower bound of ‖e_y − p‖²
        if entropies is not None:
            sq = sq + (torch.exp(-entropies.detach().float()) - p.pow(2)).clamp(min=0)
        a_sq = hidden[:, first:first + C]  # (B, T) -> (B, C): the head's inputs at the scored positions
        logps.register_hook(self._grad_hook(add, sq * a_sq * scale**2, first, hidden.shape[1]))

    def _grad_hook(self, add: Callable[[torch.Tensor], None], factor: torch.Tensor, first: int,
                   seq: int) -> Callable[[torch.Tensor], None]:
        def on_grad(g: torch.Tensor) -> None:
            try:
                with torch.no_grad():
                    score = factor.new_zeros(factor.shape[0], seq)  # (B, T)
                    score[:, first:first + factor.shape[1]] = g.float().pow(2) * factor
                add(score)
            except Exception:  # never raise into backward
                self._failed()
                log.debug("gradloc: fused LM head score failed", exc_info=True)

        return on_grad
