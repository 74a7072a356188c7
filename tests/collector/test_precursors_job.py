"""A job's precursor values (collector/precursors/job.py) against a brute-force reference: every rank's calls folded
into one StepSlots, as if one process had run the job's micro-batches. The gather is simulated by stacking the ranks'
rows (tests/distributed/test_precursors_job.py runs it over a real gloo job)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from gradloc.collector.precursors.job import JobSlots
from gradloc.collector.precursors.slots import Reduce, SlotKey, StepSlots, unpack

H, E = 3, 4
MAX = SlotKey("attn_max_logit", "layers.0.attn", Reduce.MAX, H)
ENT = SlotKey("attn_entropy", "layers.0.attn", Reduce.SUM, 2 * H, lowest=True)
HEAD = SlotKey("logit_max_abs", "lm_head", Reduce.MAX, 1)
LSE = SlotKey("logit_lse_sq", "lm_head", Reduce.SUM, 1)
ROUTER = SlotKey("router", "moe.gate", Reduce.SUM, 1 + E)


def _calls(rng: np.random.Generator, keys: tuple[SlotKey, ...], micro_batches: int) -> list[tuple]:
    """One rank's calls of a step: (key, value, micro-batch, count, extreme, at)."""
    out = []
    for mb in range(micro_batches):
        for k in keys:
            value = torch.tensor(rng.uniform(0.1, 9.0, k.size))
            extreme = torch.tensor(float(rng.uniform(0.1, 9.0)))
            at = torch.tensor(rng.integers(0, 16, 2))
            with_extreme = k is not LSE and k is not ROUTER
            out.append((k, value, mb, float(rng.integers(1, 5)), extreme if with_extreme else None,
                        at if with_extreme else None))
    return out


def _fold(calls: list[tuple], slots: StepSlots, mb_offset: int = 0) -> None:
    for k, value, mb, count, extreme, at in calls:
        slots.update(k, value, micro_batch=mb + mb_offset, count=count, extreme=extreme, at=at)


def _step(jobs: list[JobSlots], per_rank: list[list[tuple]]) -> tuple[list[tuple[dict, bool]], dict]:
    """Every rank's row, gathered (stacked), then every rank's values; and the brute-force reference (the ranks'
    calls in one StepSlots, micro-batch m of rank r numbered 100 r + m)."""
    taken, rows = [], []
    for job, calls in zip(jobs, per_rank):
        slots = StepSlots()
        _fold(calls, slots)
        keys, pack = slots.take()
        taken.append((keys, pack))
        rows.append(job.row(keys, pack, torch.device("cpu")))
    gathered = torch.stack(rows).numpy()  # (W, n): every row has the agreed length
    out = [job.values(keys, pack.numpy() if pack is not None else None, gathered)
           for job, (keys, pack) in zip(jobs, taken)]
    ref = StepSlots()
    for r, calls in enumerate(per_rank):
        _fold(calls, ref, mb_offset=100 * r)
    keys, pack = ref.take()
    return out, unpack(keys, pack.numpy()) if keys else {}


def test_after_one_agreeing_step_every_rank_judges_the_job_s_values_equal_to_one_process_over_them_all() -> None:
    rng = np.random.default_rng(0)
    W, keys = 3, (MAX, ENT, HEAD, LSE, ROUTER)
    counters = [Counter() for _ in range(W)]
    jobs = [JobSlots(c) for c in counters]
    first, _ = _step(jobs, [_calls(rng, keys, 2) for _ in range(W)])
    assert all(not job_wide for _, job_wide in first)  # the step that agrees on the layout: own values, not counted
    for _ in range(3):
        out, ref = _step(jobs, [_calls(rng, keys, 2) for _ in range(W)])
        for values, job_wide in out:
            assert job_wide and set(values) == set(ref)
            for k, v in values.items():
                np.testing.assert_allclose(v.value, ref[k].value, rtol=1e-12)
                assert v.count == ref[k].count and v.extreme == ref[k].extreme
                if ref[k].at is None:
                    assert v.at is None and v.rank is None
                else:  # the reference numbered rank r's micro-batch m as 100 r + m
                    assert (100 * v.rank + v.at[0], *v.at[1:]) == ref[k].at
    assert not any(counters)


def test_a_slot_one_rank_did_not_fill_this_step_counts_nothing_and_a_slot_none_filled_is_left_out() -> None:
    rng = np.random.default_rng(1)
    jobs = [JobSlots(Counter()) for _ in range(2)]
    _step(jobs, [_calls(rng, (MAX, ENT, HEAD), 1) for _ in range(2)])  # agree on the three
    out, ref = _step(jobs, [_calls(rng, (MAX, ENT, HEAD), 1), _calls(rng, (HEAD,), 1)])  # rank 1: no attention
    values, job_wide = out[1]
    assert job_wide and set(values) == {MAX, ENT, HEAD}
    np.testing.assert_allclose(values[ENT].value, ref[ENT].value)  # rank 1's identity added nothing
    assert values[MAX].rank == 0 and values[HEAD].extreme == ref[HEAD].extreme
    out, _ = _step(jobs, [_calls(rng, (HEAD,), 1), _calls(rng, (HEAD,), 1)])  # attention_every: nobody measured
    assert all(job_wide and set(values) == {HEAD} for values, job_wide in out)


@pytest.mark.parametrize("late", [False, True])
def test_ranks_that_hook_different_modules_each_judge_their_own_values(late: bool) -> None:
    """A pipeline's stages (never agree), or a slot that appears on one rank mid-run (own values until the ranks
    agree again)."""
    rng = np.random.default_rng(2)
    counters = [Counter(), Counter()]
    jobs = [JobSlots(c) for c in counters]
    if late:
        _step(jobs, [_calls(rng, (MAX,), 1) for _ in range(2)])
        assert _step(jobs, [_calls(rng, (MAX,), 1) for _ in range(2)])[0][0][1]  # agreed
    for i in range(3):
        out, _ = _step(jobs, [_calls(rng, (MAX, ENT), 1), _calls(rng, (HEAD,), 1)])
        assert [job_wide for _, job_wide in out] == [False, False]
        assert all(c["precursors_own_values"] == i + 1 for c in counters)  # every step the ranks differ
        assert set(out[0][0]) == {MAX, ENT} and set(out[1][0]) == {HEAD}  # each rank's own
    if late:  # once rank 0 has seen HEAD too, the ranks agree again
        _step(jobs, [_calls(rng, (MAX, ENT, HEAD), 1), _calls(rng, (MAX, ENT, HEAD), 1)])
        out, _ = _step(jobs, [_calls(rng, (MAX, ENT, HEAD), 1), _calls(rng, (MAX, ENT, HEAD), 1)])
        assert all(job_wide for _, job_wide in out)


def test_the_agreed_layout_is_in_module_order_whatever_order_a_rank_met_them_in() -> None:
    keys = [SlotKey("attn_max_logit", f"layers.{i}.attn", Reduce.MAX, 1) for i in (10, 2, 1)]
    job = JobSlots(Counter())
    for k in keys:
        job.row((k,), torch.zeros(6, dtype=torch.float64), torch.device("cpu"))
    assert [k.layer for k in job.known] == ["layers.1.attn", "layers.2.attn", "layers.10.attn"]


def test_a_job_without_precursors_sends_two_values_and_counts_nothing() -> None:
    counters = [Counter(), Counter()]
    jobs = [JobSlots(c) for c in counters]
    for _ in range(2):
        rows = [job.row((), None, torch.device("cpu")) for job in jobs]
        assert all(r.shape == (2,) for r in rows)
        out = [job.values((), None, torch.stack(rows).numpy()) for job in jobs]
        assert out == [({}, False), ({}, False)]
    assert not any(counters)


def test_a_rank_whose_row_fails_sends_a_row_of_the_agreed_length_and_every_rank_judges_its_own(monkeypatch) -> None:
    rng = np.random.default_rng(3)
    counters = [Counter(), Counter()]
    jobs = [JobSlots(c) for c in counters]
    _step(jobs, [_calls(rng, (MAX, HEAD), 1) for _ in range(2)])  # agreed

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(jobs[1], "_row", boom)
    out, _ = _step(jobs, [_calls(rng, (MAX, HEAD), 1) for _ in range(2)])  # the rows still stack: one length
    assert [job_wide for _, job_wide in out] == [False, False] and counters[1]["precursors_errors"] == 1
    assert set(out[0][0]) == {MAX, HEAD}  # rank 0's own values
    monkeypatch.undo()
    out, _ = _step(jobs, [_calls(rng, (MAX, HEAD), 1) for _ in range(2)])
    assert [job_wide for _, job_wide in out] == [True, True]


def test_a_vocabulary_split_head_s_logsumexp_squared_is_the_whole_vocabulary_s_over_the_first_micro_batch() -> None:
    """dp 2 × tp 2, the head's logits split over the vocabulary: each rank measures its shard (its logsumexp² alone
    is not the layer's); the job's value is the whole vocabulary's, from the first micro-batch's per-position
    shard logsumexps combined over the shards — against measure.head_stats on the whole logits (large ones: the
    combination must be stable). A job without the per-position values leaves it out and says so once."""
    from gradloc.collector.precursors import measure
    from gradloc.collector.precursors.module_stats import head_keys, lse_parts_key

    B, T, V, P = 2, 6, 10, 8
    top, lse = head_keys("head")
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(B, T, generator=g) > 0.3  # (B, T): some positions not in the loss

    def step(with_parts: bool) -> tuple[list, float, float]:
        whole = [torch.randn(2, B, T, V, generator=g, dtype=torch.float64) * 40 for _ in range(2)]  # d -> (M, ...)
        per_rank, expect = [], [0.0, 0.0]
        for d in range(2):
            ref = measure.head_stats(whole[d][0], keep, P)  # the first micro-batch, every vocabulary entry
            expect[0] += float(ref["lse_sq_sum"])
            expect[1] += float(ref["n"])
            for t in range(2):
                calls = []
                for mb in range(2):
                    s = measure.head_stats(whole[d][mb][..., t * V // 2:(t + 1) * V // 2], keep, P)  # the shard
                    calls += [(top, s["max_abs"], mb, 1.0, s["max_abs"], s["max_at"]),
                              (lse, s["lse_sq_sum"], mb, s["n"], None, None)]
                    if mb == 0 and with_parts:
                        calls.append((lse_parts_key("head", P), s["lse"], mb, 1.0, None, None))
                per_rank.append(calls)
        return per_rank, *expect

    for with_parts in (True, False):
        counters = [Counter() for _ in range(4)]
        jobs = [JobSlots(c, tp=[0, 1, 0, 1], data=[0, 0, 1, 1]) for c in counters]
        agreeing, _ = _step(jobs, step(with_parts)[0])  # agreeing on the layout: each rank's own values
        assert all(not job_wide and top not in values and lse not in values for values, job_wide in agreeing)
        # (its shard's largest |logit| and logsumexp² are not the head's)
        for _ in range(2):
            per_rank, total, n = step(with_parts)
            out, _ = _step(jobs, per_rank)
            for values, job_wide in out:
                assert job_wide
                if with_parts:
                    assert values[lse].count == n  # float32 logsumexps:
                    assert values[lse].value[0] == pytest.approx(total, rel=1e-6)
                    assert not any(k.stat == "logit_lse_parts" for k in values)
                else:
                    assert lse not in values and top in values
        assert all(c == (Counter() if with_parts else Counter({"precursors_vocab_split": 1})) for c in counters)
