"""Module calls that are not plain (B, T) positions (collector/fit.py), each against a brute-force
per-position autograd reference: norms applied per head on (B, T, H, D) inputs (Qwen3's
q_norm/k_norm), and embeddings called with broadcast position ids (1, T) (GPT-2's wpe), whose
expanded output leaves training bitwise unchanged."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradloc
from gradloc.collector.layer_stats import module_layer_map
from gradloc.collector.token_hooks import TokenHooks
from tests.helpers import single_thread  # noqa: F401

B, T, H, D = 3, 5, 4, 8


class HFStyleRMSNorm(nn.Module):
    """Qwen3RMSNorm's computation (float32 normalisation, cast back, weight multiply)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


class PerHead(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)  # (B, T, H, D): one norm per head, shared weights


def _hook_scores(model: nn.Module, run, batch: int = B, seq: int = T) -> torch.Tensor:  # noqa: ANN001
    hooks = TokenHooks(model, module_layer_map(model, "module"))
    hooks.attach()
    try:
        hooks.begin(0, batch, seq)
        run().backward()
        buf = hooks.end()
    finally:
        hooks.detach()
    assert buf.dropped_calls == 0 and not buf.unscored, (buf.dropped_calls, buf.unscored)
    return buf.rows()[0]  # (B, T) summed over layers


def _per_position_sq_norm(params: list[nn.Parameter], loss_at) -> torch.Tensor:  # noqa: ANN001
    """Brute force: ‖∂ loss_at(b, t) / ∂θ‖² for every position, one autograd.grad each."""
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            gs = torch.autograd.grad(loss_at(b, t), params, retain_graph=True, allow_unused=True)
            out[b, t] = sum(float(g.double().pow(2).sum()) for g in gs if g is not None)
    return out


@pytest.mark.parametrize("norm", [HFStyleRMSNorm(D), nn.RMSNorm(D, elementwise_affine=True), nn.LayerNorm(D)],
                         ids=["hf_rms", "torch_rms", "layer_norm"])
def test_a_norm_applied_per_head_scores_the_sum_of_its_heads_contributions(norm):
    torch.manual_seed(0)
    model = PerHead(norm).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(B, T, H, D, dtype=torch.float64)
    G = torch.randn(B, T, H, D, dtype=torch.float64)  # the upstream gradient ∂L/∂y

    got = _hook_scores(model, lambda: (model(x) * G).sum())
    y = model(x)
    brute = _per_position_sq_norm(list(model.parameters()), lambda b, t: (y[b, t] * G[b, t]).sum())
    torch.testing.assert_close(got.double(), brute, rtol=2e-5, atol=1e-9)
    # not the sum of per-head squares: the heads' contributions share the weight
    per_head = sum(_per_position_sq_norm(list(model.parameters()), lambda b, t, h=h: (y[b, t, h] * G[b, t, h]).sum())
                   for h in range(H))
    assert not torch.allclose(brute, per_head)


class LearnedPositions(nn.Module):
    """GPT-2's embedding: token embeddings plus learned absolute positions called with ids (1, T)."""

    def __init__(self, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(vocab, d), nn.Embedding(T + 3, d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(2, 2 + ids.shape[1]).unsqueeze(0)  # (1, T), offset by 2
        return self.head(torch.tanh(self.wte(ids) + self.wpe(pos)))


def test_an_embedding_called_with_broadcast_positions_scores_each_position():
    torch.manual_seed(0)
    model = LearnedPositions().double()
    ids = torch.randint(11, (B, T))
    W = torch.randn(B, T, 11, dtype=torch.float64)

    hooks = TokenHooks(model, module_layer_map(model, "module"))
    hooks.attach()
    try:
        hooks.begin(0, B, T)
        (model(ids) * W).sum().backward()
        buf = hooks.end()
    finally:
        hooks.detach()
    assert buf.dropped_calls == 0 and not buf.unscored
    wpe_layer = hooks.layers.index("wpe")
    got = buf.rows()[2][wpe_layer]  # (B, T)

    # brute force: the position embedding's contribution through (b, t) is the gradient at (b, t) of an
    # explicitly expanded copy of it (each row receives the sum of its positions' gradients)
    pos = model.wpe(torch.arange(2, 2 + T).unsqueeze(0)).expand(B, T, -1)
    wide = pos.detach().clone().requires_grad_(True)
    out = model.head(torch.tanh(model.wte(ids) + wide))
    (g,) = torch.autograd.grad((out * W).sum(), wide)
    torch.testing.assert_close(got.double(), g.pow(2).sum(-1), rtol=1e-6, atol=1e-12)


def _train(build, logits, vocab: int, monitor: bool, compile: bool = False) -> tuple[dict, object]:  # noqa: ANN001
    """Four AdamW steps on random ids (B, T + 1), with or without gradloc: (final parameters, last record)."""
    torch._dynamo.reset()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = gradloc.watch(model, opt, store=False, detector=gradloc.DetectorConfig(warmup=2)) if monitor else None
    run = torch.compile(model) if compile else model
    g = torch.Generator().manual_seed(1)
    rec = None
    for _ in range(4):
        ids = torch.randint(vocab, (B, T + 1), generator=g)
        with mon.micro_batch(ids[:, 1:]) if mon else torch.enable_grad():
            loss = nn.functional.cross_entropy(logits(run, ids[:, :-1]).reshape(-1, vocab), ids[:, 1:].reshape(-1))
            loss.backward()
        rec = mon.end_step(loss).record if mon else None
        opt.step()
        opt.zero_grad()
    if mon:
        mon.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, rec


def _seeded_positions() -> nn.Module:
    torch.manual_seed(0)
    return LearnedPositions()


def test_broadcast_positions_train_bitwise_the_same_and_are_attributed():
    (watched, rec), (plain, _) = (_train(_seeded_positions, lambda m, x: m(x), 11, on) for on in (True, False))
    for name, p in plain.items():
        assert torch.equal(p, watched[name]), name
    assert rec.tokens.unattributed_share == 0.0


def test_a_compiled_hf_gpt2_with_broadcast_positions_trains_bitwise_the_same():
    """HF GPT-2 through torch.compile (inductor): wpe's expanded output inside the graph leaves the
    parameters bitwise those of the same compiled run without gradloc, and everything is scored."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from tests.collector.rules.hf_zoo import VOCAB, build

    counters.clear()
    (watched, rec), (plain, _) = (_train(lambda: build("gpt2"), lambda m, x: m(x).logits, VOCAB, on, compile=True)
                                  for on in (True, False))
    assert not counters["graph_break"], dict(counters["graph_break"])
    for name, p in plain.items():
        assert torch.equal(p, watched[name]), name
    assert rec.tokens.unattributed_share == 0.0
