"""The precursor statistics of one call (collector/precursors/measure.py) against brute-force references: attention
built whole (every row, the full T×S) and read at the sampled rows, the head's logits, the residual stream, a
router's choices."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradloc.collector.precursors import measure
from gradloc.collector.precursors.intercept import SDPA, attention_call
from gradloc.collector.precursors.slots import Reduce, SlotKey, StepSlots, unpack
from gradloc.collector.precursors.stats import to_stats
from gradloc.config import PrecursorConfig
from gradloc.records import PrecursorKind


def _reference_attention(q, k, mask, causal, scale):
    """Every row's logits and entropies, the textbook way: (B, H, T, S) logits with −inf where masked."""
    B, H, T, D = q.shape
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    logits = torch.einsum("bhtd,bhsd->bhts", q.double(), k.double()) * (scale or 1 / math.sqrt(D))
    allowed = torch.ones(T, k.shape[2], dtype=torch.bool)
    if causal:
        allowed = torch.tril(allowed)
    logits = logits.masked_fill(~allowed, -math.inf)
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.double()
    ent = torch.zeros(B, H, T, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                row = logits[b, h, t]
                if torch.isinf(row).all():
                    ent[b, h, t] = math.nan
                    continue
                p = torch.softmax(row, -1)
                ent[b, h, t] = -sum(float(x) * math.log(float(x)) for x in p if x > 0)
    return logits, ent


@pytest.mark.parametrize("case", ["causal", "gqa_bool_mask", "float_mask_scale", "all_masked_row"])
def test_sampled_attention_matches_the_whole_matrix_read_at_its_rows(case: str) -> None:
    g = torch.Generator().manual_seed(len(case))
    B, H, Hk, T, D = 2, 4, 4, 12, 8
    mask, causal, scale = None, False, None
    if case == "causal":
        causal = True
    elif case == "gqa_bool_mask":
        Hk = 2
        mask = torch.rand(B, 1, T, T, generator=g) > 0.3
        mask[..., 0] = True  # every row sees a key
    elif case == "float_mask_scale":
        mask, scale = torch.randn(1, H, T, T, generator=g), 0.3
    else:
        mask = torch.ones(B, H, T, T, dtype=torch.bool)
        mask[0, :, 5] = False  # one query row of the first sample sees no key
    q = torch.randn(B, H, T, D, generator=g) * 3
    k = torch.randn(B, Hk, T, D, generator=g)
    rows = measure.query_rows(T, 5, q.device)
    assert rows.tolist() == [0, 3, 6, 8, 11]  # evenly spaced, first and last
    # what an SDPA call is measured with (a causal call without a mask: its rows' key counts from causal())
    got = attention_call(SDPA, (q, k, None), {"attn_mask": mask, "is_causal": causal, "scale": scale}, 5)
    logits, ent = _reference_attention(q, k, mask, causal, scale)
    at = logits[:, :, rows]  # (B, H, Q, S)
    finite = torch.where(torch.isinf(at), torch.full_like(at, -math.inf), at)
    assert torch.allclose(got["max"].double(), finite.amax(dim=(0, 2, 3)), rtol=1e-5)
    e = ent[:, :, rows]
    assert torch.allclose(got["entropy_sum"].double(), torch.nan_to_num(e, nan=0.0).sum(dim=(0, 2)), rtol=1e-5)
    assert got["rows"].tolist() == (~torch.isnan(e)).sum(dim=(0, 2)).tolist()
    b, t = got["max_at"].tolist()
    assert float(finite[b, :, rows.tolist().index(t)].max()) == pytest.approx(float(finite.max()), rel=1e-6)
    # the most concentrated row: entropy / log(keys it sees), over rows that see at least 2 keys
    keys = (~torch.isinf(at)).sum(-1).double()  # (B, H, Q)
    norm = torch.where(~torch.isnan(e) & (keys >= 2), e / keys.clamp(min=2).log(), torch.full_like(e, math.inf))
    # float32's floor on a row's entropy: its s = Σ exp(logit − max) = 1 + r rounds at ~6e-8 (measure.py)
    assert float(got["min_row"]) == pytest.approx(float(norm.min()), rel=1e-5, abs=2e-7)
    lb, lt = got["min_at"].tolist()
    assert float(norm[lb, :, rows.tolist().index(lt)].min()) == pytest.approx(float(norm.min()), rel=1e-5)


def test_eager_weights_are_read_on_every_row() -> None:
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 6, 4, generator=g), torch.randn(1, 2, 6, 4, generator=g)
    logits, ent = _reference_attention(q, k, None, True, None)
    got = measure.attention_stats(logits.float())  # a softmax's input, as an eager attention hands it over
    assert torch.allclose(got["entropy_sum"].double(), ent.sum(dim=(0, 2)), rtol=1e-5)
    assert got["rows"].tolist() == [6.0, 6.0]
    # the most concentrated row is judged against log(keys it sees): never the first row (one key)
    b, t = got["min_at"].tolist()
    assert t >= 1


def test_head_residual_and_router_match_brute_force() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 7, 11, generator=g) * 4
    keep = torch.rand(2, 7, generator=g) > 0.4
    got = measure.head_stats(logits, keep)
    kept = logits[keep]  # (N, V)
    assert float(got["max_abs"]) == pytest.approx(float(kept.abs().max()))
    assert float(got["lse_sq_sum"]) == pytest.approx(float(torch.logsumexp(kept.double(), -1).square().sum()), rel=1e-6)
    assert float(got["n"]) == keep.sum()
    r, t = got["max_at"].tolist()
    assert keep[r, t] and float(logits[r, t].abs().max()) == pytest.approx(float(got["max_abs"]))

    x = torch.randn(3, 5, 16, generator=g)
    s = measure.rms_stats(x)
    rms = [[math.sqrt(float((x[b, t].double() ** 2).mean())) for t in range(5)] for b in range(3)]
    assert float(s["sum"]) == pytest.approx(sum(map(sum, rms)), rel=1e-6)
    assert float(s["max"]) == pytest.approx(max(map(max, rms)), rel=1e-6)

    router = torch.randn(10, 6, generator=g)
    chosen = router.topk(2, -1).indices
    r1, r2 = measure.router_stats(router, chosen, 2), measure.router_stats(router, None, 2)
    counts = np.bincount(chosen.flatten().numpy(), minlength=6)
    assert r1["counts"].tolist() == r2["counts"].tolist() == counts.tolist()
    p = torch.softmax(router.double(), -1)
    assert float(r1["entropy_sum"]) == pytest.approx(float(-(p * p.log()).sum()), rel=1e-6)


def test_slots_fold_micro_batches_and_the_records_name_where() -> None:
    slots = StepSlots()
    H = 3
    k_max, k_ent = SlotKey("attn_max_logit", "blocks.0", Reduce.MAX, H), \
        SlotKey("attn_entropy", "blocks.0", Reduce.SUM, 2 * H, lowest=True)
    slots.update(k_max, torch.tensor([1.0, 5.0, 2.0]), micro_batch=0, extreme=torch.tensor(5.0),
                 at=torch.tensor([1, 7]))
    slots.update(k_max, torch.tensor([4.0, 3.0, 6.0]), micro_batch=1, extreme=torch.tensor(6.0),
                 at=torch.tensor([0, 2]))
    slots.update(k_ent, torch.tensor([2.0, 4.0, 6.0, 2.0, 2.0, 2.0]), micro_batch=0, extreme=torch.tensor(0.3),
                 at=torch.tensor([1, 4]))
    slots.update(k_ent, torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0]), micro_batch=1, extreme=torch.tensor(0.5),
                 at=torch.tensor([0, 9]))
    router = SlotKey("router", "moe.gate", Reduce.SUM, 1 + 4)
    slots.update(router, torch.tensor([8.0, 6.0, 2.0, 0.0, 0.0]), micro_batch=0, count=4.0)
    keys, pack = slots.take()
    assert not slots and keys == (k_max, k_ent, router)
    from collections import Counter

    counters = Counter()
    stats = {(s.kind, s.head): s for s in to_stats(unpack(keys, pack.numpy()), True, counters)}
    assert stats[(PrecursorKind.ATTN_MAX_LOGIT, None)].value == 6.0
    assert stats[(PrecursorKind.ATTN_MAX_LOGIT, None)].at == (1, 0, 2)
    assert [stats[(PrecursorKind.ATTN_MAX_LOGIT, h)].value for h in range(H)] == [4.0, 5.0, 6.0]
    # mean entropy per head: (2 + 1) / 3, (4 + 1) / 3, (6 + 1) / 3; the layer's is the lowest head's
    assert stats[(PrecursorKind.ATTN_ENTROPY, None)].value == pytest.approx(1.0)
    assert stats[(PrecursorKind.ATTN_ENTROPY, None)].at == (0, 1, 4)
    assert stats[(PrecursorKind.ROUTER_ENTROPY, None)].value == 2.0  # 8 nats over 4 tokens
    assert stats[(PrecursorKind.EXPERT_LOAD_MAX, None)].value == pytest.approx(6.0 / 2.0)
    assert stats[(PrecursorKind.DEAD_EXPERTS, None)].value == 2.0
    assert not counters


def test_a_non_finite_value_is_left_out_and_counted() -> None:
    from collections import Counter

    slots, counters = StepSlots(), Counter()
    key = SlotKey("logit_max_abs", "head", Reduce.MAX, 1)
    slots.update(key, torch.tensor([math.inf]), micro_batch=0, extreme=torch.tensor(math.inf), at=torch.tensor([0, 0]))
    keys, pack = slots.take()
    assert to_stats(unpack(keys, pack.numpy()), False, counters) == ()
    assert counters["precursors_nonfinite"] == 1


@pytest.mark.parametrize("bad", [dict(attention_queries=0), dict(attention_every=0), dict(per_head=1),
                                 dict(attention_micro_batches=-1), dict(attention_micro_batches=True),
                                 dict(attention_queries=2.5)])
def test_bad_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        PrecursorConfig(**bad)


def test_the_head_s_logsumexp_on_sampled_positions_is_their_mean_over_kept_ones() -> None:
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 10, 7, generator=g) * 3
    keep = torch.rand(3, 10, generator=g) > 0.3
    got = measure.head_stats(logits, keep, positions=6)
    at = measure.query_rows(30, 6, logits.device)  # evenly spaced over the 3·10 positions
    flat_keep = keep.reshape(-1)[at]
    lse = torch.logsumexp(logits.reshape(30, 7)[at].double(), -1)
    assert float(got["n"]) == flat_keep.sum()
    assert float(got["lse_sq_sum"]) == pytest.approx(float(lse[flat_keep].square().sum()), rel=1e-6)
    sampled = logits.reshape(30, 7)[at][flat_keep]  # the maxima: the same sampled, kept positions
    assert float(got["max_abs"]) == pytest.approx(float(sampled.abs().max()))
    r, t = got["max_at"].tolist()
    assert r * 10 + t in at.tolist() and keep[r, t]
    assert float(logits[r, t].abs().max()) == pytest.approx(float(got["max_abs"]))


def test_the_causal_masks_kept_are_bounded_and_right_after_a_clear() -> None:
    """Sequences of many lengths (dynamic padding) keep at most ``_CAUSAL_KEPT`` masks; one rebuilt is the same."""
    rows = measure.query_rows(40, 5, torch.device("cpu"))
    first = [t.clone() for t in measure.causal(rows, 40)]
    for S in range(41, 41 + 2 * measure._CAUSAL_KEPT):
        measure.causal(rows, S)
        assert len(measure._CAUSAL) <= measure._CAUSAL_KEPT
    bias, keys = measure.causal(rows, 40)  # cleared since: built again
    assert torch.equal(bias, first[0]) and torch.equal(keys, first[1])
    assert keys.tolist() == [r + 1 for r in rows.tolist()]
    assert torch.equal(torch.isinf(bias), torch.arange(40)[None, :] > rows[:, None])  # −inf after each row


def test_a_slot_folds_its_calls_as_they_came_whatever_their_number() -> None:
    """Calls are folded at ``take``: one call is packed as it is, several as folding them one by one into the slot's
    identity makes it — a NaN extreme never taken (the next finite one is), sums in float64."""
    slots = StepSlots()
    key = SlotKey("residual_rms", "norm", Reduce.SUM, 1)
    slots.update(key, torch.tensor([1.0]), micro_batch=0, count=4.0, extreme=torch.tensor(math.nan),
                 at=torch.tensor([0, 1]))
    slots.update(key, torch.tensor([2.0 ** -30]), micro_batch=1, count=torch.tensor(2.0), extreme=torch.tensor(3.0),
                 at=torch.tensor([1, 5]))
    slots.update(key, torch.tensor([1.0]), micro_batch=2, count=4.0, extreme=torch.tensor(2.0), at=torch.tensor([0, 2]))
    lone = SlotKey("logit_max_abs", "head", Reduce.MAX, 1, lowest=False)
    slots.update(lone, torch.tensor([math.nan]), micro_batch=0, extreme=torch.tensor(math.nan), at=torch.tensor([0, 0]))
    plain = SlotKey("logit_lse_sq", "head", Reduce.SUM, 1)
    slots.update(plain, torch.tensor([7.5]), micro_batch=1, count=3.0)
    keys, pack = slots.take()
    assert pack.dtype == torch.float64 and keys == (key, lone, plain)
    got = unpack(keys, pack.numpy())
    assert got[key].value[0] == 2.0 + 2.0 ** -30  # float32 would lose the small term
    assert got[key].count == 10.0 and got[key].extreme == 3.0 and got[key].at == (1, 1, 5)
    assert math.isnan(got[lone].value[0]) and got[lone].extreme == -math.inf and got[lone].at is None
    assert got[plain].value[0] == 7.5 and got[plain].count == 3.0 and got[plain].extreme == -math.inf
    assert not slots and slots.take() == ((), None)
    # a slot whose calls do not all carry an extreme: every value folded, the located one kept
    slots.update(key, torch.tensor([1.5]), micro_batch=0, count=1.0, extreme=torch.tensor(0.5), at=torch.tensor([2, 3]))
    slots.update(key, torch.tensor([2.5]), micro_batch=1, count=1.0)
    got = unpack(*(lambda k, p: (k, p.numpy()))(*slots.take()))[key]
    assert got.value[0] == 4.0 and got.count == 2.0 and got.extreme == 0.5 and got.at == (0, 2, 3)


def test_low_precision_weights_are_measured_in_float32() -> None:
    """An eager bf16 attention's softmax input and a bf16 head's logits: the entropies and logsumexps are those of
    their bf16 values, computed in float32 (in bf16 a concentrated row's entropy, ~1e-3 here, is below the dtype's
    resolution near 1, and a logsumexp keeps 3 digits)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 16, 64, generator=g) * 2
    logits[..., 0] += 9.0  # every row concentrated on its first key
    low = logits.to(torch.bfloat16)
    got = measure.attention_stats(low)
    ref = -(torch.softmax(low.double(), -1) * torch.log_softmax(low.double(), -1)).sum(-1)  # (B, H, Q)
    assert got["entropy_sum"].dtype == torch.float32
    assert torch.allclose(got["entropy_sum"].double(), ref.sum(dim=(0, 2)), rtol=1e-5)
    assert float(got["min_row"]) == pytest.approx(float((ref / math.log(64)).min()), rel=1e-4)
    head = (torch.randn(2, 8, 500, generator=g) * 6).to(torch.bfloat16)  # a bf16 head's logits (B, T, V)
    lse = torch.logsumexp(head.double().reshape(16, 500), -1)  # (B·T,)
    assert float(measure.head_stats(head)["lse_sq_sum"]) == pytest.approx(float(lse.square().sum()), rel=1e-6)


def test_large_logits_keep_their_digits() -> None:
    """A collapsed attention row (logits in the thousands, entropy ~1e-6) and a head with logits in the hundreds:
    the entropy and the logsumexp against float64 references."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(1, 2, 3, 64, generator=g) * 3
    logits[0, 0, 1, 7] = 4000.0 + 18.0  # one key dominates: entropy ~ 64·18·e^-18 ≈ 1.8e-5
    logits[0, 0, 1] += 4000.0
    got = measure.attention_stats(logits.float())
    ref = torch.softmax(logits.double(), -1)
    ent = -(ref * torch.log_softmax(logits.double(), -1)).sum(-1)  # (1, 2, 3)
    assert torch.allclose(got["entropy_sum"].double(), ent.sum(dim=(0, 2)), rtol=1e-5)
    assert float(ent[0, 0, 1]) < 1e-4  # the most concentrated row, its entropy to 4 digits
    assert float(got["min_row"]) == pytest.approx(float(ent[0, 0, 1]) / math.log(64), rel=1e-4)
    assert got["min_at"].tolist() == [0, 1]
    head = torch.randn(2, 5, 300, generator=g) * 200
    s = measure.head_stats(head)
    lse = torch.logsumexp(head.double().reshape(10, 300), -1)
    assert float(s["lse_sq_sum"]) == pytest.approx(float(lse.square().sum()), rel=1e-6)
    assert torch.allclose(s["lse"].double(), lse, rtol=1e-6)
