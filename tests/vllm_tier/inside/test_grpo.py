"""GRPO on real vLLM rollouts, watched by gradloc: the join, the trainer-vs-engine gap, a planted mismatch.

No mocks. A real ``vllm.LLM`` (the session's engine, float32) samples n=4 completions for each of 8
prompts with their logprobs; the real ``RequestOutput`` objects go through ``gradloc.adapters.rl.join``;
a ``transformers`` ``LlamaForCausalLM`` loaded from the same safetensors (float32) teacher-forces the
join's rows and takes one GRPO step per rollout batch under ``gradloc.watch``: token-mean PPO-clip loss
−min(ρ·A, clip(ρ, 1 ± ε)·A) · w with ρ = π_train / π_old (old = the trainer's own detached log-probs:
one update per batch, so ρ = 1), the untruncated importance weight w = π_old / π_rollout that corrects
for the engine's numerics, and group-normalised advantages A = (r − mean_group) / (std_group + 1e-4).

The reward (:func:`reward`) prefers completions that end themselves on EOS, and shorter ones among
those: r = 1 − 0.5 · len / MAX_TOKENS for a completion that stopped on EOS, −0.5 for one cut at the
length limit. A group whose 4 completions all hit the limit has A = 0 (no gradient), as in GRPO.

The detector's baseline comes from ``WARMUP`` healthy GRPO steps, each on its own rollout batch (engine
seed = step); ``DetectorConfig(warmup=WARMUP)`` shortens the default 25-step warm-up to keep the tier fast
(no absolute threshold: the spike must stand out of the measured healthy spread). ``QUIET`` more healthy
steps follow, on which the armed detector must raise nothing, then the spike step. The healthy steps
compute the full loss and backward but do not update the weights: the engine keeps the weights it loaded,
and this tier cannot sync new ones into it (vLLM's CPU backend repacks every linear layer's weight into a
prepacked GEMM handle at load time and leaves an empty parameter, so a TRL-style in-place ``load_weights``
has nothing to write to; see tests/vllm_tier/README.md). Every step is therefore on-policy, and the only
difference between π_old and π_rollout is the two engines' numerics — a weight-synced RL loop at its best.

The spike step's rollouts get one planted culprit: one response token's ``Logprob`` in the real
``RequestOutput`` is lowered by ``CORRUPTION`` nats before the join, so its importance weight is
exp(8) ≈ 3000. It must be located with at most 3 probes, at the right (micro-batch, sample, position),
with the right request id and completion index, and classified ``train_inference_mismatch`` with a log
ratio ≈ the corruption. Both layouts: padded rows (``Rollouts.rows``) and packed rows
(``Rollouts.packed()``, one (1, N) row per micro-batch: transformers' Llama runs block-diagonal attention
for it on CPU when the attention mask is None, position ids restart at 0, and — easy to miss — there is
no KV cache: ``use_cache=False``; with the default cache it silently attends across sequences).
"""
from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass, field, replace

import pytest
import torch

import gradloc
from tests.vllm_tier.inside import engine
from tests.vllm_tier.inside.grpo import MICRO_BATCHES, Batch, N, grpo_step, make_batch, sample_batch

pytestmark = pytest.mark.vllm

WARMUP = 6  # healthy GRPO steps that make the detector's baseline (its warm-up)
QUIET = 2  # healthy steps after the warm-up, on which the detector must stay quiet
SPIKE = WARMUP + QUIET  # the step with the planted culprit (the last)
CORRUPTION = 8.0  # nats taken off one response token's engine logprob in the spike step
# Bound on |log π_train − log π_rollout| for an unplanted token: same weights, both float32. The engine smoke
# test measures max 1.2e-4 over 386 tokens (test_engine_smoke.MAX_GAP, same bound); a bf16 engine is off by
# up to 1.7 nats, so a dtype or weight mismatch fails it.
MAX_GAP = 1e-3
# Packed vs padded rows through the same transformers model: the same computation up to the order of
# floating-point operations (measured max ~1e-5 on the logits); cross-sequence attention would be off by ~30.
MAX_LAYOUT_GAP = 1e-4


@pytest.fixture(scope="module")
def batches(llm, tokenizer, measured):
    """SPIKE + 1 rollout batches (8 prompts × n=4 × ≤16 tokens, T=1, logprobs=0), engine seed = step."""
    return [sample_batch(llm, tokenizer, seed=s) for s in range(SPIKE + 1)]


# -- 1. the join on real RequestOutputs ---------------------------------------------------------------

def test_join_rows_are_the_engine_tokens_and_logprobs(batches, tokenizer):
    for b in batches:
        ro = b.rollouts
        pairs = [(o, c) for o in b.outs for c in o.outputs]
        assert len(ro.sample_ids) == len(pairs) == len(engine.PROMPTS) * N and len(set(ro.sample_ids)) == len(pairs)
        for i, (o, c) in enumerate(pairs):
            seq, P, R = list(o.prompt_token_ids) + list(c.token_ids), len(o.prompt_token_ids), len(c.token_ids)
            info = ro.infos[i]
            assert (info.request_id, info.completion_index, info.finish_reason) == (o.request_id, c.index,
                                                                                     c.finish_reason)
            assert (info.prompt_tokens, info.response_start, info.response_tokens) == (P, P - 1, R)
            assert int(ro.groups[i]) == engine.PROMPTS.index(o.prompt)
            assert ro.input_ids[i, :len(seq)].tolist() == seq  # exactly prompt + completion ids (EOS kept)
            assert (ro.input_ids[i, len(seq):] == tokenizer.pad_token_id).all()
            assert ro.attention_mask[i].sum() == len(seq)
            mask = ro.loss_mask[i]
            assert mask.nonzero()[:, 0].tolist() == list(range(P - 1, P - 1 + R))  # the positions scoring the response
            assert ro.targets[i, mask].tolist() == list(c.token_ids)
            assert ro.targets[i, :len(seq) - 1].tolist() == seq[1:]
            want = torch.tensor([pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)], dtype=torch.float32)
            assert torch.equal(ro.rollout_logp[i, mask], want)  # the engine's own numbers, bit for bit
            assert ro.rollout_logp[i, ~mask].isnan().all()
    # the reward gives GRPO something to learn from: groups with and without spread
    adv = torch.cat([b.advantages for b in batches])
    assert (adv != 0).any() and (adv == 0).any()


# -- the GRPO run --------------------------------------------------------------------------------------

@dataclass
class Run:
    reports: list = field(default_factory=list)
    gaps: list = field(default_factory=list)  # |log π_train − log π_rollout| on healthy steps' loss positions
    train_logp: list = field(default_factory=list)  # per step: {(sample id, response token index): log π_train}


def plant(batch: Batch, tokenizer) -> Batch:
    """A copy of ``batch`` whose real RequestOutputs have one response token's logprob lowered by
    CORRUPTION — in the second micro-batch, in the completion with the largest |advantage| (a row with
    A = 0 carries no gradient to spike), at the middle of its response — joined again."""
    outs = copy.deepcopy(batch.outs)
    S = len(batch.rollouts.sample_ids)
    second = range(S - S // MICRO_BATCHES, S)
    row = max(second, key=lambda r: abs(float(batch.advantages[r])))
    assert abs(float(batch.advantages[row])) > 0.5
    info = batch.rollouts.infos[row]
    o = next(o for o in outs if o.request_id == info.request_id)
    c = o.outputs[info.completion_index]
    k = len(c.token_ids) // 2
    tok = c.token_ids[k]
    c.logprobs[k][tok] = replace(c.logprobs[k][tok], logprob=c.logprobs[k][tok].logprob - CORRUPTION)
    out = make_batch(outs, tokenizer)
    out.planted = (row, k)
    return out


def fed_sequences(mb, layout: str) -> list[list[int]]:
    """The token ids the trainer's model gets, one list per sequence."""
    if layout == "padded":
        return [mb.input_ids[row, :n].tolist() for row, n in enumerate(mb.lengths)]
    cu = mb.cu_seqlens.tolist()
    return [mb.input_ids[0, a:b].tolist() for a, b in zip(cu, cu[1:])]


def run_grpo(model_dir, batches: list[Batch], layout: str) -> Run:
    model = engine.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    det = gradloc.DetectorConfig(warmup=WARMUP)
    mon = gradloc.watch(model, detector=det, update_ratio="off", store=False)
    run = Run()
    try:
        for batch in batches:
            report, mbs, logps = grpo_step(model, mon, batch, layout)
            run.reports.append(report)
            model.zero_grad(set_to_none=True)
            run.train_logp.append(_by_response_token(mbs, logps, layout))
            check_fed_tokens(batch, mbs, layout)
            if batch.planted is None:
                for mb, lp in zip(mbs, logps):
                    run.gaps += (lp[mb.loss_mask] - mb.rollout_logp[mb.loss_mask]).abs().tolist()
    finally:
        mon.close()
    return run


def _by_response_token(mbs, logps, layout) -> dict:
    """{(sample id, response token index): log π_train} for every response token of the step."""
    out = {}
    for mb, lp in zip(mbs, logps):
        for s, info in enumerate(mb.infos):
            start = int(mb.cu_seqlens[s]) if layout == "packed" else 0
            row = lp[0] if layout == "packed" else lp[s]
            for k in range(info.response_tokens):
                out[(mb.sample_ids[s], k)] = float(row[start + info.response_start + k])
    return out


def check_fed_tokens(batch: Batch, mbs, layout: str) -> None:
    """Check 1, trainer side: the sequences the model computed on are the engine's prompt + completion ids."""
    by_request = {o.request_id: o for o in batch.outs}
    for mb in mbs:
        for info, seq in zip(mb.infos, fed_sequences(mb, layout), strict=True):
            o = by_request[info.request_id]
            assert seq == list(o.prompt_token_ids) + list(o.outputs[info.completion_index].token_ids)


@pytest.fixture(scope="module")
def runs(model_dir, batches, tokenizer, measured):
    spiked = [*batches[:SPIKE], plant(batches[SPIKE], tokenizer)]
    out = {layout: run_grpo(model_dir, spiked, layout) for layout in ("padded", "packed")}
    for layout, run in out.items():
        g = sorted(run.gaps)
        p99 = g[min(len(g) - 1, int(0.99 * len(g)))]  # as test_engine_smoke
        measured[f"GRPO {layout}: |log π_train − log π_rollout|, {SPIKE} healthy steps"] = (
            f"{len(g)} tokens: median {statistics.median(g):.2e}, p99 {p99:.2e}, max {g[-1]:.2e}")
        norms = [rep.spike.global_norm for rep in run.reports[:SPIKE]]
        z = ", ".join(f"{rep.spike.z:.1f}" for rep in run.reports[WARMUP:SPIKE])
        measured[f"GRPO {layout}: healthy global norm"] = f"{min(norms):.2f}–{max(norms):.2f}; z after warm-up: {z}"
    return spiked, out


# -- 2. the trainer-vs-engine gap on healthy steps ----------------------------------------------------

@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_trainer_and_engine_agree_on_unplanted_tokens(runs, layout):
    _, out = runs
    run = out[layout]
    assert len(run.gaps) > 0 and max(run.gaps) < MAX_GAP
    for rep in run.reports[:SPIKE]:  # gradloc's own view of the same gap: no mismatched token
        rl = rep.record.rl
        assert rl.tokens > 0 and rl.mismatch_fraction == 0.0 and rl.max_abs_log_ratio < MAX_GAP
    assert max(rep.record.rl.max_abs_log_ratio for rep in run.reports[:SPIKE]) == pytest.approx(max(run.gaps), rel=1e-3)
    for rep in run.reports[WARMUP:SPIKE]:  # the armed detector stays quiet on healthy steps
        assert rep.spike.z is not None and rep.spike.kinds == () and rep.incident is None


def test_packed_rows_compute_what_padded_rows_compute(runs):
    """Packed attention is block-diagonal: every response token's log π_train equals the padded one's."""
    _, out = runs
    for padded, packed in zip(out["padded"].train_logp, out["packed"].train_logp, strict=True):
        assert padded.keys() == packed.keys()
        assert max(abs(padded[k] - packed[k]) for k in padded) < MAX_LAYOUT_GAP


# -- 3/4. the planted mismatch, localized and classified ----------------------------------------------

@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_planted_rollout_logprob_is_located_and_classified_as_mismatch(runs, layout, measured):
    spiked, out = runs
    batch, rep = spiked[SPIKE], out[layout].reports[SPIKE]
    row, k = batch.planted
    info = batch.rollouts.infos[row]
    assert rep.incident is not None, rep.spike
    loc = rep.incident.localization
    measured[f"GRPO {layout}: planted mismatch"] = (
        f"{loc.status} with {loc.probes} probe(s), explained share {loc.explained_share:.3f}, norm "
        f"{loc.global_norm:.3g} (z {rep.spike.z:.0f}) -> {loc.norm_without_culprits:.3g} without the culprit")
    assert loc.status == "located" and loc.probes <= 3
    top = loc.culprits[0]
    size = len(batch.rollouts.sample_ids) // MICRO_BATCHES
    assert (top.micro_batch, top.sample, top.position) == (row // size, row % size, info.response_start + k)
    assert top.sample_info == info  # the request and completion it came from, with its spans
    assert (top.sample_info.request_id, top.sample_info.completion_index) == (info.request_id, info.completion_index)
    assert top.position - top.sample_info.response_start == k
    o = next(o for o in batch.outs if o.request_id == info.request_id)
    assert top.token_id == o.outputs[info.completion_index].token_ids[k]  # the sampled token gradloc blamed
    assert top.classification.kind == "train_inference_mismatch", top.classification
    assert rep.incident.classification.kind == "train_inference_mismatch"
    assert top.rl.log_ratio == pytest.approx(CORRUPTION, abs=MAX_GAP)
    evidence = {e.name: e.value for e in top.classification.evidence}
    assert evidence["log_ratio"] == pytest.approx(CORRUPTION, abs=MAX_GAP)
    assert top.rl.ratio == pytest.approx(1.0) and top.rl.clipped is False  # on-policy: the PPO ratio did nothing
    assert rep.record.rl.mismatch_fraction == pytest.approx(1 / rep.record.rl.tokens)
    assert math.isclose(rep.record.rl.max_abs_log_ratio, CORRUPTION, abs_tol=MAX_GAP)
