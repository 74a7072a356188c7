"""The loss head's reads (collector/head_read.py) against brute force, and the pack's label-alignment rows
(collector/surprise.py) on a head gradient whose model knows the text: labels shifted by k are found at k."""
from __future__ import annotations

import numpy as np
import torch

import gradloc
from gradloc.collector.batch import make_meta
from gradloc.collector.head_read import head_shift, offsets, read_head
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.collector.surprise import ROWS, SurprisePack
from gradloc.collector.token_summary import stack_step
from gradloc.demo.model import token_losses
from gradloc.detector.samples import _misaligned
from tests.helpers import single_thread, tiny_gpt  # noqa: F401

B, T, V, K = 3, 20, 11, 6


def test_head_shift_is_the_gradient_at_the_neighbour_read_at_the_label():
    g = torch.randn(B, T, V)
    labels = torch.randint(0, V, (B, T))
    labels[1, 3] = -100  # not a column: 0 wherever it is read
    got = head_shift(g, labels, B, T, K)
    assert got.shape == (2 * K, B, T)
    for i, k in enumerate(offsets(K)):
        for b in range(B):
            for t in range(T):
                inside = 0 <= t + k < T and labels[b, t] >= 0
                want = float(g[b, t + k, labels[b, t]]) if inside else 0.0
                assert float(got[i, b, t]) == want, (k, b, t)


def test_head_shift_of_vocabulary_shards_adds_up_to_the_whole():
    g, labels = torch.randn(B, T, V), torch.randint(0, V, (B, T))
    parts = head_shift(g[..., :5], labels, B, T, K, columns=0) + head_shift(g[..., 5:], labels, B, T, K, columns=5)
    torch.testing.assert_close(parts, head_shift(g, labels, B, T, K))


def _pack(text: torch.Tensor, labels: torch.Tensor, sure: float = 0.9) -> np.ndarray:
    """The pack of one micro-batch whose model predicts ``text[:, t + 1]`` at t with probability ``sure`` (the rest
    spread evenly), trained on ``labels`` with a token-mean loss: g = w·(q − onehot(labels))."""
    q = torch.full((B, T, V), (1 - sure) / (V - 1))
    q.scatter_(-1, text[:, 1:, None], sure)  # (B, T, V): the model knows the text
    q[0, 0] = 1e-7  # one position sure of another token than its label: ŵ = max_p u_p reads w (surprise.py)
    q[0, 0, (labels[0, 0] + 1) % V] = 1 - (V - 1) * 1e-7
    w = 1.0 / (B * T)
    g = w * (q - torch.nn.functional.one_hot(labels, V).float())
    buf = MicroBatchScores(0, B, T, 1, labels=labels, shifts=K)
    read_head(buf, g, g.square().sum(-1))
    scores = stack_step([(make_meta(0, labels, None, None, None), buf)], 1, torch.device("cpu"), heads=True,
                        shifts=K)
    return SurprisePack(4, 9.21).pack(scores, set()).numpy()


def test_labels_shifted_by_k_are_predicted_best_k_positions_away():
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, V, (B, T + 8), generator=gen)
    right = text[:, 1:T + 1]
    for k, labels in ((-1, text[:, :T]), (5, text[:, 6:T + 6]), (2, text[:, 3:T + 3])):
        host = _pack(text[:, :T + 1], labels)
        best, gain, t = _misaligned(host[1 + ROWS * B:].reshape(-1, B))  # (4K·B,) -> (4K, B)
        assert (best == k).all(), (k, best)
        assert (gain > 2.0).all() and (t > 5).all(), (gain, t)  # ~20 positions a sample
    host = _pack(text[:, :T + 1], right)  # the right labels: no neighbour predicts them better than their own
    gains, ts = np.split(host[1 + ROWS * B:].reshape(-1, B), 2)  # (4K·B,) -> (2K, B) each
    assert (gains < -2.0).all() and (ts < 0).all(), (gains, ts)
    assert len(host) == 1 + (ROWS + 4 * K) * B


def test_a_real_monitor_reads_the_neighbours_and_can_turn_them_off():
    V2 = 64
    for shifts, rows in ((8, 16), (0, None)):
        model = tiny_gpt(vocab=V2)
        mon = gradloc.watch(model, torch.optim.SGD(model.parameters(), 0.0), embedded=False, update_ratio="off",
                            max_overhead=None, samples=gradloc.SampleConfig(label_shifts=shifts))
        x, y = torch.randint(0, V2, (2, 12)), torch.randint(0, V2, (2, 12))
        with mon.micro_batch(y):
            logits = model(x)
            token_losses(logits, y).mean().backward()
        ((_, buf),) = mon._parts
        if rows is None:
            assert buf.head_shift is None
        else:
            q = logits.detach().softmax(-1)
            want = (q - torch.nn.functional.one_hot(y, V2).float()) / y.numel()
            torch.testing.assert_close(buf.head_shift, head_shift(want, y, 2, 12, shifts), rtol=1e-4, atol=1e-7)
            assert buf.head_shift.shape == (rows, 2, 12)
        mon.end_step(torch.zeros(()))
        mon.close()
