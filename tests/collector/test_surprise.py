"""Per-sample surprise from the loss head's gradient (collector/surprise.py) through a real monitor:
exact values against the model's own logits, and the bad inputs (nothing crashes, nothing is
attributed to the wrong sample)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradloc
from gradloc.collector.batch import make_meta
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.collector.surprise import MB_JUDGED, MB_NOT_CE, MB_RL, ROWS, SurprisePack
from gradloc.collector.token_summary import stack_step
from gradloc.demo.model import token_losses
from tests.helpers import single_thread, tiny_gpt  # noqa: F401

V, T, B = 128, 16, 4
CAP = 9.21


def _watch(model, **kw):
    cfg = dict(embedded=False, update_ratio="off", max_overhead=None,
               samples=gradloc.SampleConfig(warmup_samples=8, min_tokens=4, window=4, **kw.pop("samples", {})))
    cfg.update(kw)
    return gradloc.watch(model, torch.optim.SGD(model.parameters(), 0.0), **cfg)


def _head_u(mon):
    return [buf.head_u for _, buf in mon._parts]


def test_head_u_is_the_weight_times_one_minus_p():
    """u_p = −∂L/∂logit_p[y_p] = w·(1 − p(y_p)) for a token-mean cross-entropy (w = 1/(B·T))."""
    model = tiny_gpt(vocab=V)
    mon = _watch(model)
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    with mon.micro_batch(y):
        logits = model(x)
        token_losses(logits, y).mean().backward()
    p = logits.detach().float().softmax(-1).gather(-1, y[..., None]).squeeze(-1)  # (B, T)
    (u,) = _head_u(mon)
    torch.testing.assert_close(u, (1 - p) / (B * T), rtol=1e-5, atol=1e-9)
    mon.end_step(torch.zeros(()))
    mon.close()


def test_the_pack_holds_the_models_own_calibration_deficit():
    """‖g_p‖² at the head gives Σ_v p_v²: the pack's Σ d per sample is Σ_p (Σ_v p_v² − p(y_p)) from the exact
    softmax (up to ŵ's error)."""
    model = tiny_gpt(vocab=V)
    mon = _watch(model)
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    y[0, 0] = int(model(x[:1])[0, 0].argmin())  # a token the model finds (nearly) impossible: ŵ ≈ w
    with mon.micro_batch(y):
        logits = model(x)
        token_losses(logits, y).mean().backward()
    q = logits.detach().double().softmax(-1)  # (B, T, V)
    ((meta, buf),) = mon._parts
    u, g2 = buf.head_u, buf.head_g2
    g = q - torch.nn.functional.one_hot(y, V).double()  # the head's output gradient / w
    torch.testing.assert_close(g2.double(), g.square().sum(-1) / (B * T) ** 2, rtol=1e-4, atol=0.0)
    one = MicroBatchScores(0, B, T, 1, head_u=u, head_g2=g2)
    scores = stack_step([(make_meta(0, y, None, None, None), one)], 1, torch.device("cpu"), heads=True)
    host = SurprisePack(4, CAP).pack(scores, set()).numpy()
    n, deficit, var = host[1:1 + B], host[1 + 5 * B:1 + 6 * B], host[1 + 6 * B:1 + 7 * B]
    p = q.gather(-1, y[..., None]).squeeze(-1)  # (B, T)
    np.testing.assert_allclose(deficit, (q.square().sum(-1) - p).sum(1).numpy(), atol=0.03)  # ŵ: w·max(1 − p)
    assert (n == T).all()
    c = q.square().sum(-1)  # (B, T) Σ_v p_v²: the spread bound Σ_p max(c^1.5 − c², 1e-4) per sample
    np.testing.assert_allclose(var, (c.pow(1.5) - c.square()).clamp_min(1e-4).sum(1).numpy(), rtol=0.05)
    mon.end_step(torch.zeros(()))
    mon.close()


def test_the_heads_vocabulary_is_reduced_once_for_its_score_and_the_surprise(monkeypatch):
    """‖g_p‖² of the head's output gradient is one reduction: the head Linear's score and head_g2 both come from
    it (token_hooks, registry.reusing_sq_norm), with the same numbers as when each reduced it on its own."""
    import contextlib

    from gradloc.collector import token_hooks
    from gradloc.collector.rules import registry

    vocab = 200  # no other watched output has 200 features (d_model 32, MLP 128)
    reduced: list[tuple[int, ...]] = []
    real = torch.linalg.vector_norm

    def counting(t, *a, **kw):
        if t.shape[-1] == vocab:
            reduced.append(tuple(t.shape))
        return real(t, *a, **kw)

    def one_micro_batch():
        model = tiny_gpt(vocab=vocab)
        mon = _watch(model)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randint(0, vocab, (B, T), generator=gen), torch.randint(0, vocab, (B, T), generator=gen)
        with mon.micro_batch(y):
            logits = model(x)
            logits.retain_grad()
            token_losses(logits, y).mean().backward()
        ((_, buf),) = mon._parts
        out = (buf.scores.clone(), buf.head_g2.clone(), logits.grad.float().square().sum(-1))  # (B, T, V) -> (B, T)
        mon.end_step(torch.zeros(()))
        mon.close()
        return out

    monkeypatch.setattr(registry.torch.linalg, "vector_norm", counting)
    scores, g2, exact = one_micro_batch()
    assert reduced == [(B, T, vocab)]  # once per micro-batch
    reduced.clear()
    monkeypatch.setattr(token_hooks, "reusing_sq_norm", lambda t, sq: contextlib.nullcontext())  # each its own
    scores_apart, g2_apart, _ = one_micro_batch()
    assert reduced == [(B, T, vocab), (B, T, vocab)]
    assert torch.equal(scores, scores_apart) and torch.equal(g2, g2_apart)  # the same numbers, bit for bit
    torch.testing.assert_close(g2, exact, rtol=1e-5, atol=0.0)


def _pack(u: torch.Tensor, mask: torch.Tensor | None = None, window: int = 4, rl=(), cu=None) -> np.ndarray:
    buf = MicroBatchScores(0, u.shape[0], u.shape[1], 1, head_u=u)
    eligible = None if mask is None else mask
    meta = make_meta(0, torch.zeros(u.shape, dtype=torch.long), eligible, None, None, cu_seqlens=cu)
    scores = stack_step([(meta, buf)], 1, torch.device("cpu"), heads=True)
    return SurprisePack(window, CAP).pack(scores, set(rl)).numpy()


def test_pack_recovers_the_surprise_without_knowing_the_weight():
    """With one token the model found impossible (p = 0) in the micro-batch, ŵ = w exactly and every
    sample's mean surprise is the mean of −log p capped at CAP nats; the worst window is found."""
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(B, T, generator=gen) * 0.9 + 0.05
    p[2, 3] = 0.0
    p[1, 8:12] = 1e-3  # a corrupted span of 4 positions in sample 1
    w = 0.37 / (B * T)
    host = _pack(w * (1 - p))
    code, n, total, nonfinite, wmax, wstart, *_ = host[:1], *host[1:1 + ROWS * B].reshape(ROWS, B)  # (ROWS·B,) -> (ROWS, B)
    s = (-torch.log(p.clamp_min(math.exp(-CAP)))).double()
    assert code.tolist() == [MB_JUDGED] and n.tolist() == [T] * B and nonfinite.tolist() == [0] * B
    np.testing.assert_allclose(total / n, s.mean(1).numpy(), rtol=1e-5)
    windows = s.unfold(1, 4, 1).mean(-1)  # (B, T - 3)
    np.testing.assert_allclose(wmax, windows.max(1).values.numpy(), rtol=1e-5)
    assert wstart[1] == 1 * T + 8  # flat start of the corrupted span


def test_pack_refuses_heads_that_are_not_cross_entropy_and_rl_micro_batches():
    u = torch.rand(B, T) - 0.5  # signs of both kinds: not w·(softmax − onehot) with w > 0
    assert _pack(u)[0] == MB_NOT_CE
    assert _pack(torch.rand(B, T), rl=(0,))[0] == MB_RL


def test_packed_rows_give_one_sample_per_sequence_and_windows_stay_inside_them():
    u = torch.full((1, 20), 0.5)
    u[0, 0] = 1.0  # p = 0 somewhere: ŵ = 1
    u[0, 6:9] = 0.999  # the end of sequence 0 and the start of sequence 1 are surprising
    host = _pack(u, cu=[0, 8, 20], window=4)
    n, wstart = host[1:3], host[9:11]
    assert n.tolist() == [8, 12]
    assert wstart[0] + 4 <= 8 and wstart[1] >= 8  # no window crosses the boundary


def _run(mon, model, steps, data, weights=None, mask=None, ids=None, rl_for=None):
    reports = []
    for s in range(steps):
        loss = torch.zeros(())
        for i in range(2):
            x, y = data[s, i, :, :-1], data[s, i, :, 1:]
            with mon.micro_batch(y, loss_mask=None if mask is None else mask(s, i),
                                 sample_ids=ids or [f"s{s}-{i}-{b}" for b in range(B)]):
                terms = token_losses(model(x), y)
                if weights is not None:
                    terms = terms * weights(s, i)
                if rl_for is not None and rl_for(s, i):
                    mon.rl_fields(logp=-terms.detach(), rollout_logp=-terms.detach())
                part = terms.mean() / 2
                part.backward()
            loss += part.detach()
        reports.append(mon.end_step(loss))
    return reports


def test_bad_samples_are_counted_never_judged_and_never_blamed():
    """A sample with no loss positions, an all-padding micro-batch and a sample whose loss is NaN:
    counted, not judged, no outlier names another sample; training is not disturbed."""
    model = tiny_gpt(vocab=V)
    mon = _watch(model)
    data = torch.randint(0, V, (12, 2, B, T + 1))
    nan_step, pad_step = 9, 10

    def mask(s, i):
        m = torch.ones(B, T, dtype=torch.bool)
        m[3] = False  # sample 3 of every micro-batch has no loss position
        if s == pad_step and i == 1:
            m[:] = False  # an all-padding micro-batch
        return m

    def weights(s, i):
        w = mask(s, i).float()
        if s == nan_step and i == 0:
            w[1] = float("nan")  # sample 1's loss is NaN
        return w

    reports = _run(mon, model, 12, data, weights=weights, mask=mask)
    mon.close()
    stats = [r.record.samples for r in reports]
    assert all(st.judged + st.unjudged + st.nonfinite == 2 * B for st in stats)
    assert stats[0].unjudged == 2 and stats[0].judged == 2 * B - 2  # the two empty samples
    assert stats[nan_step].nonfinite == 1 and stats[nan_step].judged == 2 * B - 3
    assert stats[pad_step].judged == B - 1 and stats[pad_step].unjudged == B + 1
    assert not any(o.micro_batch == 0 and o.sample == 1 for o in stats[nan_step].outliers)
    assert mon.counters["sample_errors"] == 0


def test_sample_ids_that_do_not_match_the_batch_are_refused_at_micro_batch():
    model = tiny_gpt(vocab=V)
    mon = _watch(model)
    with pytest.raises(gradloc.BatchMetadataError, match="sample_ids has 3 entries for a micro-batch of 4 samples"):
        with mon.micro_batch(torch.zeros(B, T, dtype=torch.long), sample_ids=["a", "b", "c"]):
            pass
    mon.close()


def test_rl_micro_batches_are_not_judged_and_the_baseline_is_reported():
    model = tiny_gpt(vocab=V)
    mon = _watch(model, samples=dict(rl_warmup=3))
    data = torch.randint(0, V, (6, 2, B, T + 1))
    reports = _run(mon, model, 6, data, rl_for=lambda s, i: i == 1)
    mon.close()
    last = reports[-1].record.samples
    assert last.unjudged == B and last.judged == B  # micro-batch 1 gave RL fields
    assert last.rl_mismatch_baseline == 0.0  # logp == rollout_logp: no token mismatches


def test_garbage_sample_is_an_outlier_on_a_model_that_learned_its_data():
    """TinyGPT learns a fixed cycle of ids; a sample of random ids is then flagged with its id, span and
    excerpt, and no healthy sample is."""
    torch.manual_seed(0)
    model = tiny_gpt(vocab=V)
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    mon = gradloc.watch(model, opt, embedded=False, update_ratio="off", max_overhead=None,
                        decode=lambda ids: " ".join(map(str, ids)),
                        samples=gradloc.SampleConfig(warmup_samples=64, min_tokens=8, window=8))
    cycle = torch.arange(64) * 7 % V  # a deterministic sequence the model can learn
    gen = torch.Generator().manual_seed(1)
    bad_step = 149
    flagged = []
    for s in range(bad_step + 1):
        loss = torch.zeros(())
        for i in range(2):
            starts = torch.randint(0, 64, (B,), generator=gen)
            w = torch.stack([cycle.roll(-int(a))[: T + 1] for a in starts])  # (B, T + 1)
            if s == bad_step and i == 1:
                w[2] = torch.randint(0, V, (T + 1,), generator=gen)
            with mon.micro_batch(w[:, 1:], sample_ids=[f"s{s}-{i}-{b}" for b in range(B)]):
                part = token_losses(model(w[:, :-1]), w[:, 1:]).mean() / 2
                part.backward()
            loss += part.detach()
        report = mon.end_step(loss)
        opt.step()
        opt.zero_grad()
        flagged += [(s, o.micro_batch, o.sample) for o in report.record.samples.outliers]
    mon.close()
    assert flagged == [(bad_step, 1, 2)]
    (o,) = report.record.samples.outliers
    assert o.kind == "surprise" and o.sample_id == f"s{bad_step}-1-2" and o.z >= 6 and o.score > o.baseline
    assert o.text and o.start == 0 and o.end == T
