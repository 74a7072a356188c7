"""MoE per-token rules (rules/experts.py, rules/router.py, rules/sinks.py) against per-token autograd,
under every experts implementation transformers offers on CPU; the five model families with nothing
left unattributed; a planted culprit in an MoE model localized with ≤ 3 probes."""
from __future__ import annotations

import warnings

import pytest
import torch

import gradloc
from gradloc.collector.rules import rule_for
from gradloc.demo.model import token_losses
from tests.collector.rules.hf_zoo import FAMILIES, MOE, VOCAB, build, experts_of
from tests.helpers import single_thread, train_random_lm  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore")
N, IMPLS = 10, ("eager", "batched_mm", "grouped_mm")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", MOE)
def test_fused_experts_scores_match_per_token_autograd(family, impl):
    model = build(family)
    model.set_experts_implementation(impl)
    experts = experts_of(model)
    assert type(rule_for(experts)).__name__ == "FusedExpertsRule"
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)  # biases too: every parameter carries gradient
    H, E, K = 64, 4, 2
    x = torch.randn(N, H, generator=g)
    idx = torch.rand(N, E, generator=g).argsort(-1)[:, :K]  # (N, K) distinct experts per token
    w = torch.softmax(torch.randn(N, K, generator=g), -1)
    G = torch.randn(N, H, generator=g)

    got = rule_for(experts).score(experts, (x, idx, w), G)
    params = [p for p in experts.parameters() if p.requires_grad]
    y = experts(x, idx, w)  # the implementation's own forward
    brute = torch.stack([sum(gr.double().pow(2).sum() for gr in torch.autograd.grad(
        (y[p] * G[p]).sum(), params, retain_graph=True)) for p in range(N)])
    torch.testing.assert_close(got.double(), brute, rtol=2e-4, atol=1e-10)


def _train(model, steps: int = 3, plant: tuple | None = None, probes: bool = False):
    return train_random_lm(model, VOCAB, steps, plant, probes, logits=lambda out: out.logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_with_a_rule_is_attributed(family):
    """Trained a few steps on random tokens, so that every part carries gradient: every parameter has a
    rule (gpt-oss's attention sinks included, under its eager attention), nothing is unattributed."""
    model = build(family)
    reports, covered = _train(model)
    rec = reports[-1].record
    model.zero_grad()
    x = torch.randint(VOCAB, (4, 17), generator=torch.Generator().manual_seed(9))
    token_losses(model(x[:, :-1]).logits, x[:, 1:]).mean().backward()
    sq = {n: float(p.grad.double().pow(2).sum()) for n, p in model.named_parameters() if p.grad is not None}
    uncovered = {n for n in sq if n.rsplit(".", 1)[0] not in covered}
    assert uncovered == set()
    assert rec.tokens.dropped_calls == 0 and rec.tokens.unattributed_share == 0.0


@pytest.mark.parametrize("family", ["qwen3moe", "gptoss"])
def test_a_planted_culprit_in_an_moe_model_is_localized(family):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reports, _ = _train(build(family), steps=6, plant=(5, 1, 2, 7), probes=True)
    loc = reports[5].incident.localization
    assert loc.status == "located" and loc.probes <= 3, loc.note
    assert [(c.micro_batch, c.sample, c.position) for c in loc.culprits][:1] == [(1, 2, 7)]
    assert loc.explained_share > 0.5


def _one_micro_batch(model, x: torch.Tensor):  # noqa: ANN001, ANN202
    """(scores buffer, token layers) of one micro-batch x (B, T + 1) through gradloc's hooks (summed loss)."""
    from gradloc.collector.layer_stats import module_layer_map
    from gradloc.collector.token_hooks import TokenHooks

    hooks = TokenHooks(model, module_layer_map(model, "module"))
    hooks.attach()
    try:
        hooks.begin(0, x.shape[0], x.shape[1] - 1)
        token_losses(model(x[:, :-1]).logits, x[:, 1:]).sum().backward()
        return hooks.end(), hooks.layers
    finally:
        hooks.detach()


@pytest.mark.parametrize("family", ["mixtral", "gptoss"])
def test_router_scores_match_per_token_autograd(family):
    """The router's score of token p is ‖∂L/∂W_router restricted to p‖² (and its bias): δ_p = ∂L/∂logits_p
    gathers the gradient through the top-k weights; brute force per token through the logits."""
    model = build(family)
    router_name, router = next((n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Router"))
    x = torch.randint(VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    buf, layers = _one_micro_batch(model, x)
    got = buf.rows()[2][layers.index(router_name)].reshape(-1)  # (B, T) -> (N,)

    model.zero_grad()
    seen = {}
    handle = router.register_forward_hook(lambda m, a, out: seen.update(logits=out[0]))
    loss = token_losses(model(x[:, :-1]).logits, x[:, 1:]).sum()
    handle.remove()
    logits = seen["logits"]
    (delta,) = torch.autograd.grad(loss, logits, retain_graph=True)
    params = [p for p in router.parameters()]
    brute = torch.stack([sum(gr.double().pow(2).sum() for gr in torch.autograd.grad(
        (logits[p] * delta[p]).sum(), params, retain_graph=True)) for p in range(16)])
    torch.testing.assert_close(got.double(), brute, rtol=1e-4, atol=1e-12)


def test_an_experts_module_of_an_unknown_layout_is_said_once_and_left_unattributed(caplog):
    """Flags that contradict the shapes (transposed, says transformers' flag; not, say the shapes): a layout
    the experts rule does not know. No rule, one warning at watch(), its gradient in unattributed_share,
    per-layer statistics as usual (the eager implementation ignores the flag, so the model still runs)."""
    import logging

    model = build("qwen3moe")
    model.set_experts_implementation("eager")
    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m.is_transposed = True
    with caplog.at_level(logging.WARNING, logger="gradloc"):
        reports, covered = _train(model)
    said = [r for r in caplog.records if "no per-token rule for" in r.getMessage()]
    assert len(said) == 1 and "Qwen3MoeExperts" in said[0].getMessage()
    assert not any(n.endswith("experts") for n in covered)
    assert 0 < reports[-1].record.tokens.unattributed_share < 1
    assert any(s.layer.endswith("experts") and s.grad_norm > 0 for s in reports[-1].record.layers)


def test_experts_inside_a_compiled_graph_are_said_once_and_left_unattributed(caplog):
    """The experts' rule recomputes data-dependently: inside torch.compile it cannot run. gradloc says so
    once, the experts' gradient is unattributed (never guessed), everything else is scored."""
    import logging

    torch._dynamo.reset()
    model = build("qwen3moe")
    model.set_experts_implementation("grouped_mm")
    mon = gradloc.watch(model, store=False, detector=gradloc.DetectorConfig(warmup=2))
    for layer in model.model.layers:
        layer.mlp.experts.compile()
    g = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="gradloc"):
        for _ in range(3):
            x = torch.randint(VOCAB, (4, 17), generator=g)
            with mon.micro_batch(x[:, 1:]):
                token_losses(model(x[:, :-1]).logits, x[:, 1:]).mean().backward()
            rep = mon.end_step(None)
            model.zero_grad()
    mon.close()
    said = [r for r in caplog.records if "per-token rule cannot" in r.getMessage()]
    assert len(said) == 1 and "mlp.experts" in said[0].getMessage()
    assert 0 < rep.record.tokens.unattributed_share < 1


def test_attention_sink_scores_match_per_position_autograd():
    """gpt-oss's sinks (eager attention, which returns the weights): the score of query position (b, t)
    is ‖∂⟨y_bt, G_bt⟩/∂sinks‖² for the attention output y with the upstream gradient G held fixed."""
    model = build("gptoss")
    model.set_attn_implementation("eager")
    name, attn = next((n, m) for n, m in model.named_modules() if type(m).__name__ == "GptOssAttention")
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(attn.sinks.shape, generator=torch.Generator().manual_seed(5)))
    x = torch.randint(VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    buf, layers = _one_micro_batch(model, x)
    assert buf.hook_errors == 0 and name in buf.scored_modules
    got = buf.rows()[2][layers.index(name)]  # (B, T)

    model.zero_grad()
    seen = {}
    handle = attn.register_forward_hook(lambda m, a, out: seen.update(y=out[0]))
    loss = token_losses(model(x[:, :-1]).logits, x[:, 1:]).sum()
    handle.remove()
    y = seen["y"]
    (G,) = torch.autograd.grad(loss, y, retain_graph=True)
    brute = torch.tensor([[float(torch.autograd.grad((y[b, t] * G[b, t]).sum(), attn.sinks,
                                                       retain_graph=True)[0].double().pow(2).sum())
                           for t in range(8)] for b in range(2)], dtype=torch.float64)
    assert brute.sum() > 0
    torch.testing.assert_close(got.double(), brute, rtol=1e-4, atol=1e-12)


def test_sinks_with_attention_dropout_are_not_scored_and_counted_unattributed():
    """Dropout on the attention weights (training with attention_dropout > 0): the sink's probability is
    no longer 1 − Σ weights, so the call is not scored (a counted hook error) and the sinks' gradient is
    in the unattributed share — never a guess."""
    model = build("gptoss")
    model.train()
    for m in model.modules():
        if type(m).__name__ == "GptOssAttention":
            m.attention_dropout = 0.1
    reports, covered = _train(model)
    assert any(n.endswith("self_attn") for n in covered)
    tokens = reports[-1].record.tokens
    assert tokens.unattributed_share > 0 and tokens.dropped_calls == 4  # 2 layers × 2 micro-batches, counted
