"""The fused LM head's per-position score (``gradloc.integrations.fused_head``) against the exact
per-position contribution to ∇W computed from materialized logits (brute force, autograd).

TRL's ``add_fused_lm_head`` (a real TRL patch on a random tiny Llama) computes the log-probs from
``lm_head.weight`` without calling ``lm_head``. The reference runs the same backbone, then
``lm_head`` on the hidden states, ``log_softmax(u / τ)``, and reads u.grad: position t's exact
score is ‖∂L/∂u_t‖²·‖a_t‖². The closed form must lie in [exact / 2, exact] (module docstring).
"""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

import gradloc
from gradloc.integrations.fused_head import FusedHeadScores
from tests.helpers import single_thread  # noqa: F401 (autouse fixture)

transformers.logging.set_verbosity_error()
B, T, P, V, TAU = 3, 12, 4, 40, 0.7


def _model(seed: int = 0, **cfg) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, **cfg)
    return LlamaForCausalLM(config)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :P] = -100  # the "prompt" is not scored
    coef = torch.randn(B, T - 1, generator=g) * 3  # ∂L/∂log π_t: any per-token weight
    return ids, labels, coef


def _fused_scores(model: LlamaForCausalLM, ids, labels, coef, soft: bool = False):
    """The LM head's (B, T) scores from gradloc, and the step's report."""
    mon = gradloc.watch(model, store=False, update_ratio="off")
    scorer = FusedHeadScores(model, mon.hooks, TAU)
    layer = mon.hooks.layers.index("lm_head")
    with mon.micro_batch(torch.nn.functional.pad(ids[:, 1:], (0, 1)), loss_mask=labels.roll(-1, 1) != -100):
        scorer.arm(True)
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        scorer.on_logps(out.log_probs, out.entropy, 0)  # (B, T - 1): position t scores token t + 1
        scorer.arm(False)
        (coef * out.log_probs).sum().backward()
        buf = mon.hooks.current
        head = buf.scores[layer].clone() if buf.scores is not None else None
    rep = mon.end_step(float((coef * out.log_probs.detach()).sum()))
    scorer.close()
    mon.close()
    return head, rep


def _exact_scores(model: LlamaForCausalLM, ids, labels, coef) -> torch.Tensor:
    """(B, T) ‖∂L/∂u_t‖²·‖a_t‖² through materialized logits (same loss, unfused)."""
    hidden = model.model(input_ids=ids).last_hidden_state  # (B, T, D)
    logits = model.lm_head(hidden[:, :-1])  # (B, T - 1, V)
    logits.retain_grad()
    tgt = labels[:, 1:]
    logp = torch.log_softmax(logits.float() / TAU, -1).gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1)
    (coef * logp * (tgt != -100)).sum().backward()
    exact = logits.grad.pow(2).sum(-1) * hidden[:, :-1].detach().pow(2).sum(-1)  # (B, T - 1)
    return torch.nn.functional.pad(exact, (0, 1))  # (B, T): the last position scores nothing


@pytest.mark.parametrize("seed,peak", [(0, 1.0), (1, 1.0), (2, 30.0), (3, 30.0)],
                         ids=["flat-0", "flat-1", "peaked-2", "peaked-3"])
def test_fused_head_score_is_within_a_factor_two_of_the_exact_one(seed: int, peak: float):
    """``peak`` scales the head's weight: 30 makes the next-token distributions peaked, where the
    unknown Σ_{v≠y} p_v² matters (the random model's flat ones make the bound nearly exact)."""
    model = _model(seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
    add_fused_lm_head(model, temperature=TAU, outputs=("log_probs", "entropy"))
    ids, labels, coef = _batch(seed)
    head, rep = _fused_scores(model, ids, labels, coef)
    model.zero_grad()
    exact = _exact_scores(model, ids, labels, coef)
    scored = labels.roll(-1, 1) != -100  # position t scores label t + 1
    scored[:, -1] = False
    assert head is not None and torch.all(head[~scored] == 0)
    ratio = head[scored] / exact[scored]
    assert ratio.min() >= 0.5 - 1e-4 and ratio.max() <= 1 + 1e-4, ratio
    assert rep.record.tokens.unattributed_share == 0.0  # every parameter is scored, the head included


def test_unsupported_head_is_unattributed_not_lost():
    """A soft-capped head (no closed form here): the head counts as called but unscored, so its
    gradient is the unattributed share."""
    model = _model(0)
    model.config.final_logit_softcapping = 30.0  # add_fused_lm_head reads it when patching
    add_fused_lm_head(model, temperature=TAU, outputs=("log_probs", "entropy"))
    ids, labels, coef = _batch(0)
    head, rep = _fused_scores(model, ids, labels, coef)
    grads = {n: p.grad.pow(2).sum() for n, p in model.named_parameters() if p.grad is not None}
    share = float(grads["lm_head.weight"] / sum(grads.values()))
    assert share > 0.05
    assert rep.record.tokens.unattributed_share == pytest.approx(share, rel=1e-4)


def test_a_head_that_ran_as_a_module_is_scored_once_by_its_own_rule():
    """Unfused forward: the Linear rule scores lm_head; the external score is refused (no double count)."""
    model = _model(0)
    ids, labels, coef = _batch(0)
    mon = gradloc.watch(model, store=False, update_ratio="off")
    scorer = FusedHeadScores(model, mon.hooks, 1.0)
    with mon.micro_batch(ids):
        scorer.arm(True)
        logits = model(input_ids=ids).logits  # (B, T, V): lm_head called as a module
        logp = torch.log_softmax(logits, -1)[..., 0]  # (B, T) any differentiable per-token term
        scorer.on_logps(logp, None, 0)
        scorer.arm(False)
        buf = mon.hooks.current
        assert buf.external_calls == {} and buf.forward_calls["lm_head"] == 1
        logp.sum().backward()
    mon.end_step(0.0)
    scorer.close()
    mon.close()
