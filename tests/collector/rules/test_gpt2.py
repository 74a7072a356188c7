"""GPT-2 (transformers' GPT2LMHeadModel, tiny, random weights, built offline) watched end to end.

Its attention and MLP projections are HF ``Conv1D`` modules; without a rule for them their gradient
was reported as unattributed. Here: every module with parameters has a rule (unattributed share 0;
the position embedding's broadcast call is still dropped, see below), each Conv1D's per-position
scores through the real hooks match the brute-force reference on GPT-2's own activations and upstream
gradients, the LM head (tied to the token embedding) is the position-exact layer, and a planted
culprit is located by attribution with at most 3 probes while training stays bitwise identical to a
run without gradloc. Dropout stays at GPT-2's default 0.1, so the probes must replay the training
pass's dropout masks.
"""
from __future__ import annotations

import torch
import transformers
from torch import nn

import gradloc
from tests.collector.rules.reference import per_position_reference
from tests.helpers import (
    SEQ,
    VOCAB,
    backward_step,
    culprit_keys,
    make_data,
    single_thread,  # noqa: F401 (autouse fixture)
    train,
)

HFConv1D = transformers.pytorch_utils.Conv1D
DET = gradloc.DetectorConfig(warmup=5)


class GPT2Logits(nn.Module):
    """GPT2LMHeadModel returning its logits tensor (the harness's loss takes logits)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0)
        self.gpt = transformers.GPT2LMHeadModel(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx).logits  # (B, T) -> (B, T, V)


def _conv1d_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, HFConv1D)]


def _record_conv1d_io(model: nn.Module, store: dict[str, list[torch.Tensor]]) -> list:
    """Keep each Conv1D's input and the gradient arriving at its output (one forward per micro-batch)."""

    def make(name: str):
        def hook(module, args, out):
            store[name] = [args[0].detach().clone()]
            out.register_hook(lambda g: store[name].append(g.detach().clone()))

        return hook

    return [m.register_forward_hook(make(n)) for n, m in model.named_modules() if isinstance(m, HFConv1D)]


def test_gpt2_every_module_covered_conv1d_scores_match_reference():
    model = GPT2Logits(seed=0)
    assert model.gpt.training
    assert model.gpt.lm_head.weight is model.gpt.transformer.wte.weight  # tied
    convs = _conv1d_names(model)
    assert len(convs) == 2 * 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj per block
    data = make_data(1, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, detector=DET)
    io: dict[str, list[torch.Tensor]] = {}
    handles = _record_conv1d_io(model, io)
    try:
        with_params = {n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
        assert mon.hooks.covered_modules == with_params  # Conv1D, Linear (the tied head), Embedding, LayerNorm
        assert set(convs) <= mon.hooks.covered_modules
        total = backward_step(model, data, 0, mon)
        buf = mon._parts[-1][1]
        # GPT-2 looks up wpe with position ids of shape (1, T), broadcast over the batch: its output is
        # expanded per (b, t) (collector/fit.py), so it is scored like every other module
        wpe = mon.hooks.layers.index("gpt.transformer.wpe")
        assert buf.hook_errors == 0 and buf.dropped_calls == 0 and not buf.unscored
        assert (buf.scores[wpe] > 0).all()
        assert mon.hooks.layers[buf.last_layer] == "gpt.lm_head"  # the exact layer: ran last in forward

        # per-position scores of every Conv1D through the real hooks vs the brute-force reference
        modules = dict(model.named_modules())
        for name in convs:
            x, g = io[name]
            ref = per_position_reference(modules[name], x, g, n_feat=1)  # (B, T)
            got = buf.scores[mon.hooks.layers.index(name)]
            assert float(ref.min()) > 0, name
            torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6 * float(ref.max()), msg=name)

        # the Conv1D parameters carry a large part of ‖∇‖²: without their rule the share would be large
        sq = {n: float(p.grad.double().pow(2).sum()) for n, p in model.named_parameters()}
        conv_share = sum(v for n, v in sq.items() if n.rsplit(".", 1)[0] in convs) / sum(sq.values())
        assert conv_share > 0.2, conv_share
        wpe_share = sq["gpt.transformer.wpe.weight"] / sum(sq.values())
        assert wpe_share > 0.01, wpe_share
        report = mon.end_step(total, probe=data.probe(model, 0))
        tok = report.record.tokens
        assert tok is not None and tok.dropped_calls == 0
        assert tok.unattributed_share == 0.0  # every Conv1D, wpe and every other module attributed
    finally:
        for h in handles:
            h.remove()
        mon.close()


def _train_to_spike(with_monitor: bool):
    """Warm-up steps, then the spike step with a planted culprit; (model, spike report, probe calls,
    whether end_step left the gradient alone, global RNG state at the end)."""
    M, spike = 2, 6
    model = GPT2Logits(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(spike + 1, M)
    planted = data.plant(spike, 1, 2, 9)
    mon = gradloc.watch(model, opt, detector=DET) if with_monitor else None
    try:
        reports = train(model, opt, data, mon, steps=spike)
        total = backward_step(model, data, spike, mon)
        rep, calls, grads_kept = None, [], True
        if mon is not None:
            assert all(r.incident is None for r in reports)
            assert all(r.record.tokens.unattributed_share == 0.0 for r in reports)  # wpe too (fit.py)
            assert all(r.record.tokens.dropped_calls == 0 for r in reports)
            grads_before = [p.grad.clone() for p in model.parameters()]
            probe = data.probe(model, spike)
            rep = mon.end_step(total, probe=lambda i, mask: calls.append(i) or probe(i, mask))
            grads_kept = all(torch.equal(g, p.grad) for g, p in zip(grads_before, model.parameters()))
        opt.step()
    finally:
        if mon is not None:
            mon.close()
    return model, planted, rep, calls, grads_kept, torch.get_rng_state()


def test_gpt2_planted_culprit_located_by_attribution_training_unchanged():
    model, planted, rep, calls, grads_kept, rng = _train_to_spike(with_monitor=True)
    assert grads_kept, "end_step / probes changed the training gradient"
    assert rep.incident is not None and "grad_spike" in rep.spike.kinds
    top = rep.record.tokens.top[0]
    assert (top.micro_batch, top.sample, top.position) == planted
    assert any(".c_" in ls.layer for ls in top.layers)  # Conv1D layers are in the culprit's breakdown
    loc = rep.incident.localization
    assert loc.method == "attribution" and loc.status == "located", loc.note
    assert culprit_keys(loc) == {planted}
    assert loc.probes <= 3 and loc.probes == len(calls)
    assert loc.explained_share >= 0.9
    assert loc.unattributed_share == 0.0  # wpe (batch-broadcast position embedding) included

    # same seed without gradloc (dropout on, probes included): bitwise-identical parameters and RNG stream
    ref_model, *_, ref_rng = _train_to_spike(with_monitor=False)
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q), f"{n} differs after training with gradloc"
    assert torch.equal(rng, ref_rng)
