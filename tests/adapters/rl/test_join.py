"""The rollout join on vLLM-shaped objects (gradloc.demo.vllm_shapes: the same attribute names and
types as vLLM 0.32's; the real engine's objects go through the same join in tests/vllm_tier)."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc.adapters.rl import RolloutError, join
from gradloc.demo.vllm_shapes import CompletionOutput, Logprob, RequestOutput


def completion(index: int, tokens: list[int], logps: list[float] | None = None, finish="length", drop=None):
    logps = logps if logps is not None else [-0.5 - 0.1 * k for k in range(len(tokens))]
    lp = [{t: Logprob(v, 1)} | ({999: Logprob(-9.0, 2)} if k % 2 else {}) for k, (t, v) in enumerate(zip(tokens, logps))]
    if drop is not None:
        lp[drop] = {12345: Logprob(-1.0, 1)}
    return CompletionOutput(index, "", tokens, sum(logps), lp, finish)


def outputs():
    return [RequestOutput("7", "p", [5, 6, 7], outputs=[completion(0, [10, 11]), completion(1, [12, 13, 14], finish="stop")]),
            RequestOutput("8", "q", [8, 9], outputs=[completion(0, [20])])]


def test_rows_targets_masks_and_logprobs_line_up():
    r = join(outputs(), pad_id=0)
    assert r.sample_ids == ("7#0", "7#1", "8#0") and r.groups.tolist() == [0, 0, 1]
    assert r.input_ids.tolist() == [[5, 6, 7, 10, 11, 0], [5, 6, 7, 12, 13, 14], [8, 9, 20, 0, 0, 0]]
    # position p scores token p + 1: the response of a 3-token prompt is scored at positions 2, 3, ...
    assert r.targets[1].tolist() == [6, 7, 12, 13, 14, 0]
    assert r.loss_mask[1].tolist() == [False, False, True, True, True, False]
    assert r.loss_mask[2].tolist() == [False, True, False, False, False, False]
    assert r.rollout_logp[1, 2:5].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert math.isnan(float(r.rollout_logp[1, 0])) and math.isnan(float(r.rollout_logp[1, 5]))
    info = r.infos[1]
    assert (info.request_id, info.completion_index, info.prompt_tokens, info.response_start,
            info.response_tokens, info.finish_reason) == ("7", 1, 3, 2, 3, "stop")
    assert r.attention_mask.sum(1).tolist() == [5, 6, 3]


def test_packed_rows_have_the_same_tokens_and_boundaries():
    r = join(outputs())
    p = r.packed()
    assert p.cu_seqlens.tolist() == [0, 5, 11, 14]
    assert p.input_ids.tolist() == [[5, 6, 7, 10, 11, 5, 6, 7, 12, 13, 14, 8, 9, 20]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2]]
    # the last position of each sequence scores nothing (it would predict the next sequence's token)
    assert p.loss_mask.tolist() == [[False, False, True, True, False, False, False, True, True, True, False,
                                     False, True, False]]
    assert int(p.loss_mask.sum()) == int(r.loss_mask.sum()) == 6
    kw = p.micro_batch_kwargs()
    assert kw["cu_seqlens"] is p.cu_seqlens and kw["sample_ids"] == r.sample_ids


def test_rows_subset_is_trimmed_to_its_longest_sequence():
    r = join(outputs()).rows([0, 2])
    assert r.input_ids.shape == (2, 5) and r.sample_ids == ("7#0", "8#0") and r.groups.tolist() == [0, 1]


def test_verify_catches_sequences_that_do_not_match():
    r = join(outputs())
    r.verify(r.input_ids.clone())
    bad = r.input_ids.clone()
    bad[1, 4] = 99
    with pytest.raises(RolloutError, match="row 1 \\(7#1\\).*position 4"):
        r.verify(bad)
    with pytest.raises(RolloutError, match="sequences"):
        r.verify(r.input_ids[:2])


BAD = [
    ("no logprobs", lambda: RequestOutput("1", None, [1], outputs=[CompletionOutput(0, "", [2], None, None)]),
     "no logprobs"),
    ("sampled token missing", lambda: RequestOutput("1", None, [1], outputs=[completion(0, [2, 3], drop=1)]),
     "do not hold the sampled token 3"),
    ("empty completion", lambda: RequestOutput("1", None, [1], outputs=[completion(0, [])]), "empty completion"),
    ("empty prompt", lambda: RequestOutput("1", None, [], outputs=[completion(0, [2])]), "empty prompt"),
    ("truncated logprobs", lambda: RequestOutput("1", None, [1], outputs=[
        CompletionOutput(0, "", [2, 3], None, [{2: Logprob(-1.0)}])]), "1 logprob entries for 2 tokens"),
    ("non-finite logprob", lambda: RequestOutput("1", None, [1], outputs=[completion(0, [2], [-math.inf])]),
     "logprob is -inf"),
]


@pytest.mark.parametrize("what,make,match", BAD, ids=[b[0] for b in BAD])
def test_bad_rollouts_are_refused_with_a_message_naming_them(what, make, match):
    with pytest.raises(RolloutError, match=match):
        join([make()])


def test_bad_rollouts_can_be_skipped_and_are_listed():
    good = RequestOutput("2", None, [1, 2], outputs=[completion(0, [3])])
    r = join([BAD[0][1](), good, BAD[2][1]()], errors="skip")
    assert r.sample_ids == ("2#0",)
    assert [(s.request_id, s.reason.split(": ")[1][:8]) for s in r.skipped] == [("1", "no logpr"), ("1", "empty co")]
    with pytest.raises(RolloutError, match="no usable completion"):
        join([BAD[0][1]()], errors="skip")


def test_vocabulary_and_length_limits():
    with pytest.raises(RolloutError, match="outside the vocabulary of 12"):
        join(outputs(), vocab_size=12)
    with pytest.raises(RolloutError, match="over max_length 5"):
        join(outputs(), max_length=5)
    r = join(outputs(), uid=lambda out, c: f"uid-{out.request_id}-{c.index}")
    assert r.sample_ids[0] == "uid-7-0"
    assert torch.equal(join(outputs()).input_ids, r.input_ids)
