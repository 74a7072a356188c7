"""gradloc's verl helpers on verl-shaped micro-batches and a verl-shaped engine.

These run in the main environment, which has no verl (verl 0.9.1 needs transformers < 5.11): they drive
``tests/integrations/verl_like.py`` in one process — batches with verl 0.9's exact field names and layouts
(nested jagged ``input_ids``/``position_ids``, padded or nested response-level fields), an engine with
``FSDPEngine``/``FSDPEngineWithLMHead``'s method names and signatures, and ``ppo_loss`` written from
verl's formulas — around a real model (TinyGPT packed with ``cu_seqlens``) and a real ``gradloc.watch``
monitor. verl's own FSDP2 engine, DataProto and core_algos losses on 2 gloo processes, probes on every
rank: the real-verl tier (tests/verl_tier, in .venv-verl).
"""
from __future__ import annotations

import pytest
import torch

import gradloc
from gradloc.collector.batch import make_meta
from gradloc.integrations.verl import GradlocVerlHooks, install, layout, masked_loss_function, rl_fields
from tests.helpers import single_thread  # noqa: F401
from tests.integrations.rl_checks import assert_mismatch_located
from tests.integrations.verl_like import (
    Batch,
    EngineWithLMHead,
    EngineWithValueHead,
    HFShaped,
    Sample,
    chunk,
    current_logp,
    loss_fn,
    make_batch,
    nested,
    random_samples,
    response_slice,
    token_terms,
)

SPIKE = 6
WATCH = dict(detector=gradloc.DetectorConfig(warmup=5), update_ratio="off", store=False)


def _samples(seed: int = 3) -> list[Sample]:
    return random_samples(torch.Generator().manual_seed(seed), n_prompts=3, n=2)


def _model_output(engine, batch) -> dict:
    """What verl's forward_step hands the loss function: nested log_probs (and entropy)."""
    seen = {}

    def capture(model_output, data, dp_group=None):
        seen.update(model_output)
        return torch.zeros(()), {}

    with torch.no_grad():
        engine.forward_step(batch, loss_function=capture, forward_only=True)
    return seen


def _log_probs(engine, batch):
    return _model_output(engine, batch)["log_probs"]


# -- layouts ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["packed", "padded", "nested_responses", "static_pad", "prepacked"])
def test_response_token_k_of_sample_i_is_scored_where_verl_scores_it(variant):
    samples = _samples()
    module = HFShaped(0)
    batch = make_batch(samples, nested_responses=variant == "nested_responses")
    if variant == "padded":
        batch["use_remove_padding"] = False
    if variant == "prepacked":
        ids = batch["input_ids"]
        batch = Batch(batch, input_ids=ids.values()[None], position_ids=batch["position_ids"].values()[None])
        lay = layout(batch, cu_seqlens=ids.offsets())
    else:
        lay = layout(batch, pad_size=3 if variant == "static_pad" else 0)
    engine = EngineWithLMHead(module)
    lp = _log_probs(engine, make_batch(samples))
    at_positions = lay.values_to_positions(lp).reshape(-1)  # the layout's shape -> (n,)
    want = current_logp(module, samples)  # each sequence run alone, unpacked
    meta = make_meta(0, lay.token_ids, lay.loss_mask, lay.sample_ids, None, lay.cu_seqlens,
                     sample_infos=lay.infos)
    off = [0, *torch.tensor([len(s.prompt) + len(s.response) for s in samples]).cumsum(0).tolist()]
    for i, s in enumerate(samples):
        for k, tok in enumerate(s.response):
            q = int(lay.flat_index[i, k])
            if variant in ("packed", "nested_responses", "static_pad", "prepacked"):
                assert q == off[i + 1] - len(s.response) + k - 1  # verl's index of token k, minus one
            assert int(lay.token_ids.reshape(-1)[q]) == tok and bool(lay.loss_mask.reshape(-1)[q])
            assert float(at_positions[q]) == pytest.approx(want[i][k], abs=1e-5)
            sample, position = meta.locate(q)
            assert sample == i and lay.response_token(sample, position) == k
    assert int(lay.loss_mask.sum()) == sum(len(s.response) for s in samples)
    assert lay.sample_ids[:4] == ("u0#0", "u0#1", "u1#0", "u1#1")
    info = lay.infos[3]
    assert (info.request_id, info.prompt_tokens, info.response_start, info.response_tokens) == \
        ("u1", len(samples[3].prompt), len(samples[3].prompt) - 1, len(samples[3].response))
    if variant == "static_pad":
        assert lay.cu_seqlens.tolist()[-2:] == [off[-1], off[-1] + 3] and lay.sample_ids[-1] == "<pad>"
        assert not bool(lay.loss_mask[0, -3:].any())


def test_masked_out_response_tokens_are_not_loss_positions_and_uids_stay_plain_when_unique():
    s = [Sample([1, 2, 3], [4, 5, 6, 7], "a", response_mask=[1, 0, 0, 1]), Sample([8, 9], [10, 11], "b")]
    lay = layout(make_batch(s))
    assert lay.loss_mask.tolist() == [[False, False, True, False, False, True, False, False, True, True, False]]
    assert lay.sample_ids == ("a", "b")


def test_rl_fields_line_up_with_the_loss_positions():
    samples = _samples()
    samples[2].old = [-0.5 - 0.1 * k for k in range(len(samples[2].response))]
    samples[2].rollout = [v - 0.25 for v in samples[2].old]
    engine = EngineWithLMHead(HFShaped(0))
    batch = make_batch(samples)
    lay = layout(batch)
    f = rl_fields(lay, batch, _log_probs(engine, batch), clip_ratio=(0.2, 0.28))
    q = int(lay.flat_index[2, 1])
    assert float(f["old_logp"].reshape(-1)[q]) == pytest.approx(-0.6)
    assert float(f["rollout_logp"].reshape(-1)[q]) == pytest.approx(-0.85)
    assert float(f["advantages"].reshape(-1)[q]) == pytest.approx(samples[2].advantage)
    want = current_logp(engine.module, samples)[2][1]
    assert float(f["ratio"].reshape(-1)[q]) == pytest.approx(float(torch.exp(torch.tensor(want + 0.6))), rel=1e-5)
    r, a = f["ratio"].reshape(-1)[q], f["advantages"].reshape(-1)[q]
    assert bool(f["clipped"].reshape(-1)[q]) == bool(torch.clamp(r, 0.8, 1.28) * a < r * a)
    outside = ~lay.loss_mask.reshape(-1)
    assert torch.isnan(f["old_logp"].reshape(-1)[outside]).all() and not f["clipped"].reshape(-1)[outside].any()


# -- the probe: same loss, same normalization ---------------------------------------------------------
def _grads(module, loss):
    module.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("nested_responses", [False, True])
def test_probe_is_the_real_loss_restricted_to_the_mask(nested_responses):
    """ppo_loss with the IS weights, the entropy bonus and the KL loss all on; batch_num_tokens and
    dp_size as a 2-rank step sets them. Full mask = the training loss; complementary masks add up;
    each probe = Σ over its tokens of the per-token terms / batch_num_tokens · dp_size."""
    g = torch.Generator().manual_seed(11)
    samples = _samples()
    engine = EngineWithLMHead(HFShaped(0))
    cur = current_logp(engine.module, samples)
    for s, c in zip(samples, cur):
        s.old = [v + 0.3 * float(torch.randn((), generator=g)) for v in c]
        s.rollout = [v + 0.2 * float(torch.randn((), generator=g)) for v in s.old]
    ref = [[v + 0.5 * float(torch.randn((), generator=g)) for v in c] for c in cur]
    batch = make_batch(samples, nested_responses=nested_responses, ref=ref)
    batch.update(batch_num_tokens=61.0, dp_size=2, calculate_entropy=True)
    lf = loss_fn(entropy_coeff=0.05, use_kl_loss=True, kl_loss_coef=0.3)
    lay = layout(batch)

    def run(fn):
        loss, _ = engine.forward_step(batch, loss_function=fn, forward_only=False)
        return float(loss.detach()), _grads(engine.module, loss)

    full_value, full = run(lf)
    value, grads = run(masked_loss_function(lf, lay, lay.loss_mask))
    assert value == pytest.approx(full_value, rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(grads, full))
    pick = torch.rand(lay.loss_mask.shape, generator=g) < 0.3
    s_mask, c_mask = lay.loss_mask & pick, lay.loss_mask & ~pick
    assert 0 < int(s_mask.sum()) < int(lay.loss_mask.sum())
    vs, gs = run(masked_loss_function(lf, lay, s_mask))
    vc, gc = run(masked_loss_function(lf, lay, c_mask))
    assert vs + vc == pytest.approx(full_value, rel=1e-5)
    assert all(torch.allclose(a + b, f, atol=1e-6) for a, b, f in zip(gs, gc, full))
    out = _model_output(engine, batch)  # the loss formula itself, token by token
    terms = token_terms(lf.keywords["config"], response_slice(out["log_probs"], batch),
                        response_slice(out["entropy"], batch), batch)
    keep = lay.to_response(s_mask)
    assert vs == pytest.approx(float((terms * keep).sum()) / 61.0 * 2, rel=1e-5)


# -- the engine wrapper ---------------------------------------------------------------------------------
def _train(plant: bool, hooks: bool, steps: int = SPIKE + 1, remove_padding: bool = True, **hook_kw):
    """GRPO-style steps through the engine: old = the current policy, rollout ≈ old (engine noise),
    untruncated IS weights exp(old − rollout) (verl's rollout correction with a large threshold).
    ``plant``: at the spike step the engine's log-prob of response token 2 of sample 5 is 8 nats off
    (IS weight e^8): micro-batch 1, sample 1, uid u2, its second sample."""
    module = HFShaped(0)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    engine = EngineWithLMHead(module, opt, clip_grad=1.0)
    h = GradlocVerlHooks(engine, **WATCH, **hook_kw) if hooks else None
    g = torch.Generator().manual_seed(7)
    lf = loss_fn()
    engine.response_tokens = []
    for step in range(steps):
        samples = random_samples(g)
        for s, c in zip(samples, current_logp(module, samples)):
            s.old = c
            s.rollout = [v + 0.01 * float(torch.randn((), generator=g)) for v in c]
        if plant and step == SPIKE:
            samples[5].rollout[2] -= 8.0
        batch = make_batch(samples)
        batch["use_remove_padding"] = remove_padding
        engine.response_tokens.append(int(batch["response_mask"].sum()))
        engine.infer_batch(batch, lf)  # compute_log_prob-style forward-only pass: passes straight through
        engine.train_batch(batch, lf)
    return engine, h, module


@pytest.mark.parametrize("remove_padding", [True, False])
def test_a_corrupted_rollout_logprob_is_located_and_classified(remove_padding):
    engine, hooks, _ = _train(plant=True, hooks=True, remove_padding=remove_padding)
    rep, top = assert_mismatch_located(hooks, SPIKE)
    assert (top.micro_batch, top.sample) == (1, 1) and top.sample_id == "u2#1"
    assert top.sample_info.request_id == "u2" and top.position - top.sample_info.response_start == 2
    assert rep.incident.classification.kind == "train_inference_mismatch"
    healthy = hooks.reports[2].record
    assert healthy.rl.tokens == engine.response_tokens[2]
    assert healthy.rl.mismatch_fraction == 0.0 and healthy.rl.clip_fraction is not None
    assert rep.record.global_norm == pytest.approx(engine.grad_norms[SPIKE], rel=1e-5)  # verl's actor/grad_norm


def test_the_hooks_never_change_the_update():
    *_, plain = _train(plant=True, hooks=False)
    _, hooks, watched = _train(plant=True, hooks=True)
    assert hooks.reports[SPIKE].incident.localization.probes > 0  # probes ran in between
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)


def test_a_static_pad_after_the_packed_row_is_part_of_the_layout():
    """verl's pad_to_length: the model sees N + pad tokens; the hooks ask the engine for the pad size."""
    module = HFShaped(0)
    engine = EngineWithLMHead(module, torch.optim.SGD(module.parameters(), lr=0.01), pad_to_length_bucket=16)
    hooks = GradlocVerlHooks(engine, **WATCH)
    for seed in (1, 2):
        batch = make_batch(_samples(seed))
        engine.train_batch(batch, loss_fn())
    rec = hooks.reports[-1].record
    assert hooks.blocks.errors == 0 and rec.tokens.dropped_calls == 0
    padded_rows = [-(-int(mb["input_ids"].values().numel()) // 16) * 16 for mb in chunk(batch, 4)]
    assert rec.tokens.tokens == sum(padded_rows)  # every micro-batch as the model saw it, pad included
    assert rec.tokens.top and all(t.sample_id != "<pad>" for t in rec.tokens.top)  # the pad scores nothing


def test_a_bad_micro_batch_fails_at_setup_and_is_skipped_after_it():
    module = HFShaped(0)
    engine = EngineWithLMHead(module, torch.optim.SGD(module.parameters(), lr=0.01))
    hooks = GradlocVerlHooks(engine, **WATCH)
    lf = loss_fn()
    good = make_batch(_samples())
    bad = make_batch(_samples())
    bad["attention_mask"][0, :] = 1  # sample 0 (first micro-batch): a response longer than its sequence
    with pytest.raises(gradloc.BatchMetadataError, match="sample 0: response of"):
        engine.train_batch(bad, lf)
    engine.train_batch(good, lf)
    odd = make_batch(_samples())
    odd["uid"] = odd["uid"][:-1]  # the second micro-batch gets 1 uid for 2 sequences (verl never reads uid)
    engine.train_batch(odd, lf)  # after setup: counted, the step still trains and is recorded
    assert hooks.blocks.errors == 1 and hooks.mon.counters["integration_layout_errors"] == 1
    assert len(hooks.reports) == 2 and len(engine.grad_norms) == 2  # the setup failure stopped its step
    hooks.detach()
    assert "forward_step" not in engine.__dict__ and "optimizer_step" not in engine.__dict__


def test_without_probes_the_culprit_is_still_ranked_but_unverified():
    """Probes are on by default (on every rank of an FSDP2 job too, in lockstep: the verl tier tests that);
    ``probes=False`` leaves attribution alone: the same top token, reported unverified, no probe run."""
    engine, hooks, _ = _train(plant=True, hooks=True, probes=False)
    assert hooks.probes is False
    loc = hooks.reports[SPIKE].incident.localization
    assert loc.probes == 0 and loc.status == "unverified", loc
    top = loc.culprits[0]
    assert (top.micro_batch, top.sample, top.sample_id) == (1, 1, "u2#1")


def test_attach_errors_and_install():
    module = HFShaped(0)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    engine = EngineWithLMHead(module, opt)
    engine.use_ulysses_sp = True
    with pytest.raises(gradloc.UnsupportedModelError, match="sequence parallelism"):
        GradlocVerlHooks(engine, **WATCH)
    engine.use_ulysses_sp = False
    hooks = GradlocVerlHooks(engine, **WATCH)
    with pytest.raises(gradloc.AttachError):
        GradlocVerlHooks(engine, **WATCH)
    hooks.detach()
    uninstall = install(EngineWithLMHead, **WATCH)
    try:
        with pytest.raises(gradloc.AttachError):
            install(EngineWithLMHead)
        actor = EngineWithLMHead(HFShaped(1), torch.optim.SGD(HFShaped(1).parameters(), lr=0.1))
        actor.initialize()
        ref = EngineWithLMHead(HFShaped(2))  # the reference policy: no optimizer
        ref.initialize()
        critic = EngineWithValueHead(HFShaped(3), torch.optim.SGD(HFShaped(3).parameters(), lr=0.1))
        critic.initialize()
        assert isinstance(actor.gradloc, GradlocVerlHooks)
        assert not hasattr(ref, "gradloc") and not hasattr(critic, "gradloc")
        actor.gradloc.detach()
    finally:
        uninstall()
    assert "initialize" not in EngineWithLMHead.__dict__


# -- bad input ------------------------------------------------------------------------------------------
def _bad(mutate, match, **kw):
    batch = make_batch(_samples())
    mutate(batch)
    with pytest.raises(gradloc.BatchMetadataError, match=match):
        lay = layout(batch, **kw)
        rl_fields(lay, batch)


def test_bad_input_gives_a_clear_error():
    n = sum(len(s.prompt) + len(s.response) for s in _samples())

    def prepack(b, cut):
        b["input_ids"] = b["input_ids"].values()[None]
        b["cu_seqlens"] = torch.tensor([0, 5, n - cut])
        del b["position_ids"]

    _bad(lambda b: prepack(b, 1), "must rise strictly from 0 to the row's N")
    def positions(b, restart_inside: bool):
        rows = [list(range(len(t))) for t in b["input_ids"].unbind()]
        if restart_inside:
            rows[1][2] = 0  # sequence 1 restarts at its third token
        else:
            rows[-1] = rows[-1][:-1]  # one position short
        b["position_ids"] = nested(rows)

    _bad(lambda b: positions(b, False), "position_ids has")
    _bad(lambda b: positions(b, True), "boundaries do not add up")
    _bad(lambda b: b["attention_mask"].__setitem__((0, slice(None)), 1), "response of .* tokens in a sequence of")
    _bad(lambda b: b.pop("input_ids"), "no input_ids")
    _bad(lambda b: b.pop("response_mask"), "no response_mask")
    _bad(lambda b: (b.pop("prompts"), b.pop("attention_mask")), "cannot tell the response lengths")
    _bad(lambda b: b.update(old_log_probs=b["old_log_probs"][:, :-1]), "old_log_probs: expected")
    _bad(lambda b: b.update(old_log_probs=nested([t[:3] for t in b["old_log_probs"]])), "nested response lengths")
    _bad(lambda b: b.update(input_ids=b["input_ids"].values()[None]), "without cu_seqlens")
    with pytest.raises(gradloc.BatchMetadataError, match="pad_size applies to a packed row only"):
        batch = make_batch(_samples())
        batch["use_remove_padding"] = False
        layout(batch, pad_size=2)


def test_verl_s_data_source_and_extra_info_index_are_each_sequence_s_provenance():
    import numpy as np

    s = [Sample([1, 2, 3], [4, 5], "a"), Sample([8, 9], [10, 11], "b"), Sample([6, 7], [12], "c")]
    batch = make_batch(s)
    batch["data_source"] = np.array(["openai/gsm8k", "lighteval/MATH", "openai/gsm8k"], dtype=object)
    batch["extra_info"] = np.array([{"split": "train", "index": 17}, {"index": 4}, {"note": "no index"}],
                                   dtype=object)  # what verl's preprocessing writes per row
    infos = layout(batch).infos
    assert [(i.source, i.origin) for i in infos] == [("openai/gsm8k", "train:17"), ("lighteval/MATH", "row 4"),
                                                     ("openai/gsm8k", None)]
    assert [i.request_id for i in infos] == ["a", "b", "c"]  # the uid and spans as before
    lay = layout(batch)  # packed (use_remove_padding): every position of a sequence carries that sequence's info
    meta = make_meta(0, lay.token_ids, lay.loss_mask, lay.sample_ids, None, lay.cu_seqlens, sample_infos=lay.infos)
    assert meta.packed and meta.n_samples == 3
    for i, sample in enumerate(s):
        for k in range(len(sample.response)):
            q = int(lay.flat_index[i, k])
            assert meta.sample_info(meta.locate(q)[0]) == infos[i]
    batch["data_source"] = np.array(["openai/gsm8k", "x" * 100, "openai/gsm8k"], dtype=object)  # past 64 characters
    assert [(i.source, i.origin) for i in layout(batch).infos] == [("openai/gsm8k", "train:17"), (None, None),
                                                                   ("openai/gsm8k", None)]  # that one keeps none
    batch["data_source"] = np.array(["only-one"], dtype=object)  # ragged: no provenance rather than a wrong one
    del batch["extra_info"]
    assert all(i.source is None and i.origin is None for i in layout(batch).infos)
