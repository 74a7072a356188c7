"""Packed micro-batches: sequences back to back in one (1, N) row, reported per sequence."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gradloc
from gradloc.collector.batch import make_meta
from gradloc.demo.model import token_losses
from tests.helpers import single_thread, tiny_gpt  # noqa: F401

LENGTHS = (5, 9, 7, 11)  # four sequences of different lengths
VOCAB = 128


# -- validation ------------------------------------------------------------------------------------
def _ids(n: int) -> torch.Tensor:
    return torch.arange(n)[None] % VOCAB  # (1, N)


@pytest.mark.parametrize("cu,match", [
    ([0, 5, 14, 20], "add up to 20 positions, but the row has N = 32"),
    ([0, 5, 5, 32], "strictly increasing"),
    ([1, 5, 32], "start at 0"),
    ([0], "start at 0 and hold S \\+ 1 offsets"),
    (torch.tensor([0.0, 32.0]), "integers"),
])
def test_bad_boundaries_are_refused(cu, match):
    with pytest.raises(gradloc.BatchMetadataError, match=match):
        make_meta(0, _ids(32), None, None, None, cu_seqlens=cu)


def test_packed_rows_are_one_row_and_ids_are_one_per_sequence():
    with pytest.raises(gradloc.BatchMetadataError, match=r"one row \(1, N\)"):
        make_meta(0, torch.zeros(2, 16, dtype=torch.long), None, None, None, cu_seqlens=[0, 16])
    with pytest.raises(gradloc.BatchMetadataError, match="3 entries for a micro-batch of 2 sequences"):
        make_meta(0, _ids(16), None, ["a", "b", "c"], None, cu_seqlens=[0, 4, 16])


def test_position_ids_that_restart_give_the_boundaries():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    meta = make_meta(0, _ids(9), None, ["x", "y", "z"], None, position_ids=pos)
    assert meta.starts == (0, 3, 5) and meta.n_samples == 3
    assert [meta.locate(f) for f in (0, 2, 3, 4, 5, 8)] == [(0, 0), (0, 2), (1, 0), (1, 1), (2, 0), (2, 3)]
    assert meta.bounds(2) == (5, 9) and meta.flat(1, 1) == 4 and meta.sample_id(1) == "y"
    assert meta.sample_tokens(1) == [3, 4]
    with pytest.raises(gradloc.BatchMetadataError, match="must start at 0"):
        make_meta(0, _ids(3), None, None, None, position_ids=torch.tensor([[1, 2, 0]]))


# -- the same sequences, padded and packed -------------------------------------------------------------
def _sequences(seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (n + 1,), generator=g) for n in LENGTHS]


def _padded(seqs):
    T = max(LENGTHS)
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    y = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s) - 1
        x[i, :n], y[i, :n], mask[i, :n] = s[:-1], s[1:], True
    return x, y, mask


def _packed(seqs):
    x = torch.cat([s[:-1] for s in seqs])[None]  # (1, N)
    y = torch.cat([s[1:] for s in seqs])[None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return x, y, torch.ones_like(y, dtype=torch.bool), cu


def _spike_step(layout: str, culprit=(2, 4), warmup: int = 6):
    """Warm-up steps then one step where sequence ``culprit[0]``'s position ``culprit[1]`` has a huge
    loss weight; both layouts see exactly the same sequences and loss (sum / 32 tokens)."""
    torch.manual_seed(0)
    model = tiny_gpt(0, seq=16)
    mon = gradloc.watch(model, detector=gradloc.DetectorConfig(warmup=warmup - 1), update_ratio="off", store=False)
    uids = [f"seq{i}" for i in range(len(LENGTHS))]
    rep = None
    for step in range(warmup + 1):
        seqs = _sequences(step)
        if layout == "padded":
            x, y, mask = _padded(seqs)
            w = mask.float()
            if step == warmup:
                w[culprit] = 4000.0
            kwargs = {}
        else:
            x, y, mask, cu = _packed(seqs)
            w = mask.float()
            if step == warmup:
                w[0, int(cu[culprit[0]]) + culprit[1]] = 4000.0
            kwargs = {"cu_seqlens": cu}

        def loss_fn(i, m=None, x=x, y=y, w=w, kwargs=kwargs):
            ww = w if m is None else w * m
            return (token_losses(model(x, **kwargs), y) * ww).sum() / sum(LENGTHS)

        with mon.micro_batch(y, loss_mask=mask, sample_ids=uids, **kwargs):
            loss = loss_fn(0)
            loss.backward()
        rep = mon.end_step(loss.detach(), probe=loss_fn)
        model.zero_grad()
    mon.close()
    return rep


def test_a_culprit_is_reported_per_sequence_in_both_layouts_with_its_own_context():
    padded, packed = _spike_step("padded"), _spike_step("packed")
    for rep in (padded, packed):
        loc = rep.incident.localization
        assert loc.status == "located" and loc.probes <= 3
        assert [(c.sample, c.position, c.sample_id) for c in loc.culprits] == [(2, 4, "seq2")]
    a, b = padded.incident.localization, packed.incident.localization
    assert a.culprits[0].token_id == b.culprits[0].token_id
    assert a.explained_share == pytest.approx(b.explained_share, rel=1e-4)
    assert a.culprits[0].score_share == pytest.approx(b.culprits[0].score_share, rel=1e-3)
    assert padded.record.tokens.top[0].score == pytest.approx(packed.record.tokens.top[0].score, rel=1e-4)
    # the span's context: this sequence's tokens only, never the neighbour's
    span = b.spans[0]
    seq2 = _sequences(6)[2][1:].tolist()  # the labels of sequence 2 at the spike step
    assert list(span.token_ids) == [seq2[4]]
    assert (span.start, span.end) == (4, 5)
    top = packed.record.tokens.top[0]
    assert (top.sample, top.position, top.sample_id) == (2, 4, "seq2")


def test_context_stops_at_the_sequence_boundary():
    seqs = _sequences(0)
    x, y, mask, cu = _packed(seqs)
    meta = make_meta(0, y, mask, None, None, cu_seqlens=cu)
    assert meta.sample_tokens(1) == y[0, 5:14].tolist()
    from gradloc.localizer.spans import range_span
    from gradloc.localizer.token_view import TokenView

    n = meta.n_tokens
    scores = np.arange(1.0, n + 1)  # (N,) one distinct score per flat position
    view = TokenView((), (meta,), (0, n), scores, None, np.ones(n, dtype=bool), 0.0)
    span = range_span(view, 0, 1, 0, 1, 1.0, lambda ids: " ".join(map(str, ids)), context=8)  # sequence 1's first token
    assert span.context_before == ""  # nothing of sequence 0 leaks in
    assert span.context_after == " ".join(map(str, y[0, 6:14].tolist()))
    # the window: sequence 1's positions 0..8 (flat 5..13), each with its own score share
    assert span.window_start == 0 and len(span.window_tokens) == 9
    assert span.window_scores == pytest.approx(tuple(scores[5:14] / scores.sum()), rel=1e-12)
    assert [t.strip() for t in span.window_tokens] == [str(t) for t in y[0, 5:14].tolist()]
