"""gradloc's OpenRLHF helpers on OpenRLHF-shaped experiences and an ActorPPOTrainer-shaped trainer.

The tests below drive ``tests/integrations/openrlhf_like.py`` in one process: ``Experience`` with
OpenRLHF 0.11's field names and layouts ((B, T) sequences right-padded, action_mask (B, T − 1) with
action j ↔ token j + 1), an actor, a PolicyLoss and a ``training_step`` written from OpenRLHF's code,
and an engine with DeepSpeed's methods (1/gas backward scaling, clip + step at the accumulation
boundary) that is not a DeepSpeed engine, so gradloc watches its module — around a real model (TinyGPT,
packed with ``cu_seqlens`` under ``packing_samples``) and a real ``gradloc.watch`` monitor. OpenRLHF's
own classes on real ZeRO-1/2/3 engines over 2 processes: tests/integrations/distributed/test_openrlhf_zero.py.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import gradloc
from gradloc.collector.batch import make_meta
from gradloc.integrations.openrlhf import GradlocOpenRLHF, PromptProvenance, install, layout, masked_loss, rl_fields
from tests.helpers import single_thread  # noqa: F401
from tests.integrations.openrlhf_like import (
    Experience,
    PolicyLoss,
    Trainer,
    fill_logprobs,
    k3,
    make_experience,
    make_trainer,
    random_rows,
    step_norms,
)
from tests.integrations.rl_checks import assert_mismatch_located

SPIKE, GAS = 6, 2
WATCH = dict(detector=gradloc.DetectorConfig(warmup=5), update_ratio="off", store=False)


def _rows(seed: int = 3, n: int = 4):
    return random_rows(torch.Generator().manual_seed(seed), n)


def _left_padded(exp: Experience) -> Experience:
    """The same rows left-padded (attention and actions shifted right by each row's padding)."""
    out = copy.copy(exp)
    B, T = exp.sequences.shape
    lens = exp.attention_mask.sum(1)
    seq, att, act = torch.zeros_like(exp.sequences), torch.zeros_like(exp.attention_mask), torch.zeros_like(exp.action_mask)
    for i in range(B):
        n, pad = int(lens[i]), T - int(lens[i])
        seq[i, pad:], att[i, pad:] = exp.sequences[i, :n], 1
        act[i, pad:] = exp.action_mask[i, :n - 1]
    out.sequences, out.attention_mask, out.action_mask = seq, att, act
    return out


# -- layouts ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["padded", "packed", "packed_left"])
def test_action_j_is_token_j_plus_1_and_lands_where_the_actor_scores_it(variant):
    rows = _rows()
    trainer = make_trainer(packing=variant != "padded")
    exp = make_experience(rows, truncated=[False, True, False, False])
    if variant == "packed_left":
        exp = _left_padded(exp)
    fill_logprobs(trainer.actor, exp)
    lay = layout(exp, packed=variant != "padded")
    assert exp.action_mask.shape[1] == exp.sequences.shape[1] - 1
    at = lay.to_positions(exp.action_log_probs).reshape(-1)
    meta = make_meta(0, lay.token_ids, lay.loss_mask, lay.sample_ids, None, lay.cu_seqlens, sample_infos=lay.infos)
    model = trainer.actor.model.module
    for i, (p, r) in enumerate(rows):
        first = int(exp.attention_mask[i].float().argmax())
        with torch.no_grad():  # the row alone, unpadded
            alone = torch.log_softmax(model(torch.tensor(p + r)[None])["logits"][0], -1)  # (T_i, V)
        for j in exp.action_mask[i].nonzero().reshape(-1).tolist():
            q = int(lay.action_index[i, j])
            assert int(lay.token_ids.reshape(-1)[q]) == int(exp.sequences[i, j + 1])  # action j ↔ token j + 1
            assert bool(lay.loss_mask.reshape(-1)[q])
            t = j + 1 - first  # the token's index in the row alone
            assert float(at[q]) == pytest.approx(float(alone[t - 1, (p + r)[t]]), abs=1e-5)
            assert meta.locate(q) == (i, j - (first if variant != "padded" else 0))
        info = lay.infos[i]
        assert (info.prompt_tokens, info.response_start, info.response_tokens) == \
            (len(p) + (first if variant == "padded" else 0), len(p) - 1 + (first if variant == "padded" else 0), len(r))
    assert int(lay.loss_mask.sum()) == int(exp.action_mask.sum()) == sum(len(r) for _, r in rows)
    assert [i.finish_reason for i in lay.infos] == ["stop", "length", "stop", "stop"]
    if variant != "padded":
        assert lay.token_ids.shape == (1, sum(len(p) + len(r) for p, r in rows))


def test_rl_fields_and_sample_ids():
    rows = _rows()
    trainer = make_trainer()
    exp = make_experience(rows, advantages=[0.5, -1.0, 2.0, 1.0])
    fill_logprobs(trainer.actor, exp)
    exp.rollout_log_probs = exp.rollout_log_probs - 0.3 * exp.action_mask.float()
    exp.index = [10, 11, 12, 13]
    lay = layout(exp)
    assert lay.sample_ids == ("10", "11", "12", "13")
    current = exp.action_log_probs + 0.1 * exp.action_mask.float()
    f = rl_fields(lay, exp, current, clip_eps=(0.2, 0.28))
    j = int(exp.action_mask[1].nonzero()[2])
    q = int(lay.action_index[1, j])
    flat = {k: v.reshape(-1) for k, v in f.items()}
    assert float(flat["old_logp"][q]) == pytest.approx(float(exp.action_log_probs[1, j]))
    assert float(flat["rollout_logp"][q]) == pytest.approx(float(exp.action_log_probs[1, j]) - 0.3, abs=1e-6)
    assert float(flat["advantages"][q]) == -1.0
    assert float(flat["ratio"][q]) == pytest.approx(float(torch.exp(torch.tensor(0.1))), rel=1e-5)
    assert bool(flat["clipped"][q]) is False  # ratio 1.105 < 1.28: the unclipped term
    assert torch.isnan(flat["logp"][~lay.loss_mask.reshape(-1)]).all()
    exp.index = None  # OpenRLHF clears it when it splits a batch
    assert layout(exp).sample_ids is None
    assert layout(exp, sample_ids=["a", "b", "c", "d"]).sample_ids == ("a", "b", "c", "d")


# -- the probe: the real training loss restricted to the mask ------------------------------------------
def test_probe_is_the_training_loss_restricted_to_the_mask():
    """PolicyLoss with TIS, the KL loss (k3) and the entropy term all on, the step's normalizers over a
    2-micro-batch window (tokens ÷ gas): the full mask reproduces training_step's loss ÷ gas (value and
    gradient), complementary masks add up, and a subset is Σ of its per-token terms."""
    g = torch.Generator().manual_seed(5)
    trainer = make_trainer(kl_coef=0.2, entropy_coef=0.05, is_threshold=(0.0, 5.0))
    exp = make_experience(_rows(), advantages=[0.5, -1.0, 2.0, 1.0])
    fill_logprobs(trainer.actor, exp, noise=0.2, g=g)
    m = exp.action_mask.float()
    exp.action_log_probs = exp.action_log_probs + 0.3 * torch.randn(m.shape, generator=g) * m
    exp.base_action_log_probs = exp.base_action_log_probs + 0.5 * torch.randn(m.shape, generator=g) * m
    other = make_experience(_rows(9))
    info = step_norms([exp, other], GAS)
    lay = layout(exp)
    params = list(trainer.actor.model.module.parameters())

    def grads_of(loss):
        for p in params:
            p.grad = None
        loss.backward()
        return [p.grad.clone() for p in params]

    trainer.training_step(exp, 0.2, 0, info)  # micro-step 1 of 2: backward (÷ gas), no optimizer step yet
    trained = [p.grad.clone() for p in params]
    full = masked_loss(trainer, exp, lay.loss_mask, lay, kl_ctl=0.2, step=0, loss_batch_info=info, gas=GAS)
    assert float(full.detach()) == pytest.approx(trainer.losses[-1] / GAS, rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(grads_of(full), trained))
    pick = torch.rand(lay.loss_mask.shape, generator=g) < 0.3
    s_mask, c_mask = lay.loss_mask & pick, lay.loss_mask & ~pick
    vs = masked_loss(trainer, exp, s_mask, lay, kl_ctl=0.2, step=0, loss_batch_info=info, gas=GAS)
    vc = masked_loss(trainer, exp, c_mask, lay, kl_ctl=0.2, step=0, loss_batch_info=info, gas=GAS)
    assert float(vs.detach()) + float(vc.detach()) == pytest.approx(float(full.detach()), rel=1e-5)
    assert all(torch.allclose(a + b, f, atol=1e-6) for a, b, f in zip(grads_of(vs), grads_of(vc), trained))
    assert exp.action_mask.dtype == torch.bool and int(exp.action_mask.sum()) == int(lay.loss_mask.sum())  # untouched
    with torch.no_grad():  # the formula, token by token
        lp, out = trainer.actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask, return_output=True,
                                return_entropy=True)
        ratio = (lp - exp.action_log_probs).clamp(-20, 20).exp()
        adv = exp.advantages
        pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        pg = pg * torch.exp(exp.action_log_probs - exp.rollout_log_probs).clamp(0.0, 5.0)
        terms = pg + 0.2 * k3(lp, exp.base_action_log_probs) - 0.05 * out.entropy
    keep = lay.to_actions(s_mask)
    assert float(vs.detach()) == pytest.approx(float((terms * keep).sum() / info["batch_num_tokens"]) / GAS, rel=1e-5)


# -- the trainer wrapper ---------------------------------------------------------------------------------
PROMPTS = SimpleNamespace(prompts=[f"prompt {n}" for n in range((SPIKE + 1) * GAS * 4)],  # a PromptDataset's lists
                          datasources=[("gsm8k", "math", "aime", "default")[n % 4] for n in range((SPIKE + 1) * GAS * 4)])


def _train(plant: bool, hooks: bool, packing: bool = False, steps: int = SPIKE + 1):
    """PPO steps of GAS micro-batches (experiences of 4 rows), normalizers per step window like
    ppo_train; IS correction on (TIS, threshold (0, 1e4)). ``plant``: at the spike step the engine's
    log-prob of action j* (the 3rd action of row 2 of micro-batch 1) is 8 nats off: IS weight e^8. Row i of
    micro-batch k of step s rolled out ``PROMPTS``' prompt (s·GAS + k)·4 + i (its datasource, PromptProvenance)."""
    trainer = make_trainer(is_threshold=(0.0, 1e4), packing=packing)
    h = GradlocOpenRLHF(trainer, provenance=PromptProvenance(PROMPTS, "prompts.jsonl"), **WATCH) if hooks else None
    g = torch.Generator().manual_seed(7)
    planted = None
    for s in range(steps):
        exps = [make_experience(random_rows(g), advantages=torch.randn(4, generator=g).tolist()) for _ in range(GAS)]
        for k, e in enumerate(exps):
            e.prompts = PROMPTS.prompts[(s * GAS + k) * 4:(s * GAS + k + 1) * 4]
            fill_logprobs(trainer.actor, e, noise=0.01, g=g)
        if plant and s == SPIKE:
            j = int(exps[1].action_mask[2].nonzero()[2])
            exps[1].rollout_log_probs[2, j] -= 8.0
            planted = (1, 2, j)
        info = step_norms(exps, GAS)
        for k, e in enumerate(exps):
            trainer.training_step(e, 0.0, s * GAS + k, info)
    return trainer, h, planted


@pytest.mark.parametrize("packing", [False, True])
def test_a_corrupted_rollout_logprob_is_located_and_classified(packing):
    trainer, hooks, planted = _train(plant=True, hooks=True, packing=packing)
    rep, top = assert_mismatch_located(hooks, SPIKE)
    assert (top.micro_batch, top.sample, top.position) == planted  # right-padded rows: position = action j
    n = (SPIKE * GAS + 1) * 4 + 2  # the planted row's prompt; packed or not, its sequence keeps its own provenance
    (info,) = {s.sample_info for s in rep.incident.localization.spans if (s.micro_batch, s.sample) == planted[:2]}
    assert (info.source, info.origin) == ("aime", f"prompts.jsonl:{n}")
    assert rep.incident.classification.kind == "train_inference_mismatch"
    engine = trainer.actor.model
    assert rep.record.global_norm == pytest.approx(engine.norms[SPIKE], rel=1e-5)  # DeepSpeed's pre-clip norm
    assert rep.record.rl.mismatch_fraction == pytest.approx(1 / rep.record.rl.tokens)


@pytest.mark.parametrize("packing", [False, True])
def test_the_policy_entropy_is_the_actor_output_s_over_the_trained_actions(packing):
    """With ``actor.entropy_coef`` set (0: computed, not in the loss) the actor's token entropies reach
    ``mon.rl_fields``: each step's ``rl.entropy_mean`` is the actions' mean entropy of the outputs the loss got
    (read here by a hook of the test's own on the actor); without it nothing is computed and no entropy is said."""
    g = torch.Generator().manual_seed(5)
    for coef in (0.0, None):
        trainer = make_trainer(entropy_coef=coef, packing=packing)
        seen: list[tuple[float, float]] = []

        def read(_m, args, _kw, out):  # (action_log_probs, output): the output's entropy over the action mask
            if isinstance(out, tuple) and "entropy" in out[1]:
                mask = args[1].float()
                seen.append((float((out[1].entropy.detach()[:, -mask.shape[1]:] * mask).sum()), float(mask.sum())))

        handle = trainer.actor.register_forward_hook(read, with_kwargs=True)
        hooks = GradlocOpenRLHF(trainer, **WATCH)
        for s in range(3):
            exps = [make_experience(random_rows(g), advantages=torch.randn(4, generator=g).tolist()) for _ in range(GAS)]
            for e in exps:
                fill_logprobs(trainer.actor, e, noise=0.01, g=g)
            info = step_norms(exps, GAS)
            for k, e in enumerate(exps):
                trainer.training_step(e, 0.0, s * GAS + k, info)
        handle.remove()
        rl = [r.record.rl for r in hooks.reports]
        assert len(rl) == 3 and hooks.mon.counters.get("rl_fields_errors", 0) == 0
        hooks.detach()
        assert not trainer.actor._forward_hooks  # gradloc's hook removed (the test's was, above)
        if coef is None:
            assert seen == [] and all(x.entropy_mean is None for x in rl)
            continue
        assert len(seen) == 3 * GAS
        for s, x in enumerate(rl):
            part = seen[s * GAS:(s + 1) * GAS]
            want = sum(a for a, _ in part) / sum(n for _, n in part)
            assert x.entropy_mean == pytest.approx(want, rel=1e-6) and x.job_entropy_mean == x.entropy_mean


def test_the_hooks_never_change_the_update():
    plain, *_ = _train(plant=True, hooks=False)
    watched, hooks, _ = _train(plant=True, hooks=True)
    assert hooks.reports[SPIKE].incident.localization.probes > 0
    for a, b in zip(plain.actor.parameters(), watched.actor.parameters()):
        assert torch.equal(a, b)


def test_a_bad_experience_fails_at_setup_and_is_skipped_after_it():
    trainer = make_trainer()
    hooks = GradlocOpenRLHF(trainer, **WATCH)
    g = torch.Generator().manual_seed(1)

    def exp():
        e = make_experience(random_rows(g))
        fill_logprobs(trainer.actor, e)
        return e

    e = exp()
    e.attention_mask[0, int(e.action_mask[0].nonzero()[0]) + 1] = 0  # an action on a token left out
    with pytest.raises(gradloc.BatchMetadataError, match="the attention_mask leaves out"):
        trainer.training_step(e, 0.0, 0, None)
    a, b = exp(), exp()
    trainer.training_step(a, 0.0, 0, step_norms([a, b], GAS))
    trainer.training_step(b, 0.0, 1, step_norms([a, b], GAS))
    c, d = exp(), exp()
    hooks.sample_ids = lambda e: ["only-one"]  # after setup: counted, the experience still trains
    trainer.training_step(c, 0.0, 2, step_norms([c, d], GAS))
    hooks.sample_ids = None
    trainer.training_step(d, 0.0, 3, step_norms([c, d], GAS))
    assert hooks.blocks.errors == 1 and hooks.mon.counters["integration_layout_errors"] == 1
    assert len(hooks.reports) == 2 and len(trainer.actor.model.norms) == 2
    hooks.detach()
    assert "training_step" not in vars(trainer) and "backward" not in vars(trainer.strategy)
    assert isinstance(trainer.actor_loss_fn, PolicyLoss)


def test_attach_refuses_what_it_cannot_do_exactly():
    trainer = make_trainer()
    trainer.strategy.ring_attn_group = object()
    with pytest.raises(gradloc.UnsupportedModelError, match="ring attention"):
        GradlocOpenRLHF(trainer, **WATCH)
    trainer.strategy.ring_attn_group = None
    for attr, value, match in (("policy_loss_type", "gspo", "gspo"), ("token_level_loss", False, "token_level_loss"),
                               ("vllm_is_correction_type", "seq-mask-tis", "seq-mask-tis"),  # 0.11.0's name
                               ("is_correction_level", "seq", "is_correction_level")):  # 0.11.2's
        t = make_trainer(is_threshold=(0.5, 2.0))
        setattr(t.actor_loss_fn, attr, value)
        with pytest.raises(gradloc.ConfigError, match=match):
            GradlocOpenRLHF(t, probes=True, **WATCH)
        hooks = GradlocOpenRLHF(t, **WATCH)  # by default: attribution-only incidents
        assert hooks.probes is False
        hooks.detach()
    trainer.aux_loss = True
    with pytest.raises(gradloc.ConfigError, match="aux loss"):
        GradlocOpenRLHF(trainer, probes=True, **WATCH)
    trainer.aux_loss = False
    hooks = GradlocOpenRLHF(trainer, **WATCH)
    assert hooks.probes is True
    with pytest.raises(gradloc.AttachError):
        GradlocOpenRLHF(trainer, **WATCH)
    hooks.detach()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_monitor_of_the_module_is_refused_under_zero_stages_that_move_p_grad(stage):
    """Under ZeRO ≥ 1 a monitor made with ``gradloc.watch(engine.module)`` reads a p.grad DeepSpeed has moved
    into its partitions: refused with the way out (no ``mon=``: the hooks watch the engine itself)."""
    trainer = make_trainer(zero_stage=stage)
    mon = gradloc.watch(trainer.actor.model.module, **WATCH)
    with pytest.raises(gradloc.UnsupportedModelError, match=f"ZeRO stage {stage}.*gradloc.watch\\(engine\\)"):
        GradlocOpenRLHF(trainer, mon)
    mon.close()
    stage0 = make_trainer(zero_stage=0)
    mon = gradloc.watch(stage0.actor.model.module, **WATCH)
    hooks = GradlocOpenRLHF(stage0, mon)  # stage 0 keeps p.grad: such a monitor is fine, probes on
    assert hooks.probes is True and hooks.mon is mon
    hooks.detach()
    mon.close()


def test_install_attaches_to_every_trainer_the_class_builds():
    uninstall = install(Trainer, **WATCH)
    try:
        with pytest.raises(gradloc.AttachError):
            install(Trainer)
        trainer = make_trainer()
        assert isinstance(trainer.gradloc, GradlocOpenRLHF) and "training_step" in vars(trainer)
        trainer.gradloc.detach()
    finally:
        uninstall()
    assert "gradloc" not in vars(make_trainer())


# -- bad input ------------------------------------------------------------------------------------------
def test_bad_input_gives_a_clear_error():
    def bad(mutate, match, **kw):
        e = make_experience(_rows())
        fill_logprobs(make_trainer().actor, e)
        mutate(e)
        with pytest.raises(gradloc.BatchMetadataError, match=match):
            rl_fields(layout(e, **kw), e)

    def hole(e):
        e.attention_mask[1, int(e.action_mask[1].nonzero()[1]) + 1] = 0

    bad(lambda e: setattr(e, "action_mask", torch.ones(4, e.sequences.shape[1], dtype=torch.bool)), "at most T − 1")
    bad(lambda e: setattr(e, "attention_mask", e.attention_mask[:3]), "do not describe the same rows")
    bad(hole, "row 1: action .* the attention_mask leaves out")
    bad(lambda e: setattr(e, "sequences", None), "sequences must be a 2-D tensor")
    bad(lambda e: setattr(e, "advantages", e.advantages[:, :-1]), "advantages: expected")
    bad(lambda e: None, "sample_ids has 2 entries for 4 rows", sample_ids=["a", "b"])

    def gap(e):  # attended tokens with a hole in the middle cannot be packed row by row
        e.attention_mask[0, 1] = 0
        e.action_mask[0, 0] = False
    bad(gap, "one non-empty run", packed=True)
