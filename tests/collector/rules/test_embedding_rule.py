"""nn.Embedding per-token rule vs a brute-force autograd reference (one table copy per position)."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from gradloc.collector.rules.embedding import EmbeddingRule
from tests.collector.rules.reference import SETTINGS, per_position_reference, rule_score


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=3), vocab=st.integers(1, 5),
       dim=st.integers(1, 6), pad=st.sampled_from([None, 0, -1]), seed=st.integers(0, 2**31 - 1))
def test_embedding_matches_per_position_autograd(lead, vocab, dim, pad, seed):
    torch.manual_seed(seed)
    emb = nn.Embedding(vocab, dim, padding_idx=pad).double()
    ids = torch.randint(0, vocab, tuple(lead))  # small vocab: repeated ids are the norm
    g = torch.randn(*lead, dim, dtype=torch.float64)

    rule, got_lead, _, score = rule_score(emb, ids, g)
    ref = per_position_reference(emb, ids, g, 0)

    assert isinstance(rule, EmbeddingRule)
    assert got_lead == tuple(lead)
    assert score.dtype == torch.float32 and tuple(score.shape) == tuple(lead)
    torch.testing.assert_close(score.double(), ref, rtol=1e-5, atol=1e-9)
    if emb.padding_idx is not None:
        assert (score[ids == emb.padding_idx] == 0).all()


def test_padding_positions_score_zero_and_others_full():
    emb = nn.Embedding(6, 4, padding_idx=2).double()
    ids = torch.tensor([[2, 1, 2, 5]])
    g = torch.ones(1, 4, 4, dtype=torch.float64)
    _, _, _, score = rule_score(emb, ids, g)
    assert score.tolist() == [[0.0, 4.0, 0.0, 4.0]]


def test_repeated_ids_are_scored_per_position_not_per_row():
    """Two positions hit the same row with opposite g: the row's gradient cancels (‖∇E‖ = 0), but each
    position still routed ‖g‖² into it; the rule reports the per-position contributions."""
    emb = nn.Embedding(5, 3).double()
    ids = torch.tensor([3, 3])
    g = torch.tensor([[1.0, 2.0, -1.0], [-1.0, -2.0, 1.0]], dtype=torch.float64)
    (emb(ids) * g).sum().backward()
    assert emb.weight.grad.abs().sum() == 0

    _, _, _, score = rule_score(emb, ids, g)
    torch.testing.assert_close(score.double(), per_position_reference(emb, ids, g, 0))
    assert score.tolist() == [6.0, 6.0]


def test_distinct_ids_scores_sum_to_table_gradient_norm():
    torch.manual_seed(3)
    emb = nn.Embedding(10, 4).double()
    ids = torch.randperm(10)[:6].reshape(2, 3)
    g = torch.randn(2, 3, 4, dtype=torch.float64)
    (emb(ids) * g).sum().backward()
    _, _, _, score = rule_score(emb, ids, g)
    torch.testing.assert_close(score.double().sum(), emb.weight.grad.pow(2).sum(), rtol=1e-6, atol=0)


# -- exact case through the real hooks --------------------------------------------------------------
def _retain_output(store: dict, key: str):
    def hook(module, args, out):
        out.retain_grad()
        store[key] = out

    return hook


def _token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    B, T, V = logits.shape
    return nn.functional.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), reduction="none").view(B, T)


def test_embedding_scores_through_hooks_equal_output_gradient_norms():
    """Token and position embeddings of TinyGPT: score_p = ‖∂L/∂(embedding output at p)‖². The position
    embedding is looked up with the same ids in every row of the batch (repeated ids)."""
    import gradloc
    from gradloc.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(8)
    B, T, V = 3, 4, 7
    model = TinyGPT(GPTConfig(vocab=V, seq=T, d_model=8, n_layers=1, n_heads=2))
    idx, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    idx[0, :] = idx[1, 2]  # repeated token ids too
    mon = gradloc.watch(model, config=gradloc.WatchConfig(update_ratio=False))
    outs: dict = {}
    handles = [model.tok.register_forward_hook(_retain_output(outs, "tok")),
               model.pos.register_forward_hook(_retain_output(outs, "pos"))]
    try:
        with mon.micro_batch(targets):
            _token_ce(model(idx), targets).mean().backward()
        buf = mon._parts[-1][1]
        layers = mon.hooks.layers
        for name in ("tok", "pos"):
            expected = outs[name].grad.pow(2).sum(-1)  # (B, T, d) -> (B, T)
            assert (expected > 0).all()
            torch.testing.assert_close(buf.scores[layers.index(name)], expected, rtol=1e-5, atol=1e-12)
        # x = tok(idx) + pos(pos): both see the same upstream gradient
        torch.testing.assert_close(buf.scores[layers.index("tok")], buf.scores[layers.index("pos")])
    finally:
        for h in handles:
            h.remove()
        mon.close()


class PaddedLM(nn.Module):
    def __init__(self, vocab: int, d: int, pad: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=pad)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + torch.tanh(self.mix(h)).cumsum(1)  # positions interact
        return self.head(h)


def test_padding_idx_positions_score_zero_through_hooks():
    import gradloc

    torch.manual_seed(9)
    B, T, V, PAD = 2, 6, 9, 0
    model = PaddedLM(V, 5, PAD)
    idx = torch.randint(1, V, (B, T))
    idx[0, 4:] = PAD
    idx[1, 0] = PAD
    targets = torch.randint(0, V, (B, T))
    mon = gradloc.watch(model, config=gradloc.WatchConfig(update_ratio=False))
    outs: dict = {}
    handle = model.emb.register_forward_hook(_retain_output(outs, "emb"))
    try:
        with mon.micro_batch(targets):
            _token_ce(model(idx), targets).sum().backward()
        score = mon._parts[-1][1].scores[mon.hooks.layers.index("emb")]
        g_sq = outs["emb"].grad.pow(2).sum(-1)
        assert (g_sq[idx == PAD] > 0).all()  # upstream gradient does arrive at padded positions...
        assert (score[idx == PAD] == 0).all()  # ...but nothing reaches the (frozen) padding row
        torch.testing.assert_close(score[idx != PAD], g_sq[idx != PAD], rtol=1e-5, atol=1e-12)
        assert model.emb.weight.grad[PAD].abs().sum() == 0
    finally:
        handle.remove()
        mon.close()


class _VocabSlice(nn.Embedding):
    """The vocab-parallel shape of torchtitan's Embedding (its own forward, ``tp_group``); with no group it is
    a plain lookup. The TP case is checked against a single-process reference in tests/distributed."""

    tp_group = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return nn.functional.embedding(input, self.weight, self.padding_idx)


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), vocab=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_vocab_parallel_embedding_without_a_group_matches_per_position_autograd(lead, vocab, seed):
    from gradloc.collector.rules.embedding import VocabParallelEmbeddingRule

    torch.manual_seed(seed)
    emb = _VocabSlice(vocab, 3).double()
    ids = torch.randint(0, vocab, tuple(lead))
    g = torch.randn(*lead, 3, dtype=torch.float64)
    rule, _, _, score = rule_score(emb, ids, g)
    assert isinstance(rule, VocabParallelEmbeddingRule)
    torch.testing.assert_close(score.double(), per_position_reference(emb, ids, g, 0), rtol=1e-5, atol=1e-9)
