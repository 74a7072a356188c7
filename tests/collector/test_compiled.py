"""Per-token statistics under torch.compile (collector/compiled.py): the whole model and each block
with ``fullgraph=True``, watched before or after compiling — the scores equal the eager hooks', no
graph break, a planted culprit located within the probe budget, training bitwise unchanged.
Compiles on CPU (inductor); OMP_NUM_THREADS=1 keeps the runs steady (tests/helpers.single_thread)."""
from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

import gradloc
from gradloc.collector.layer_stats import module_layer_map
from gradloc.collector.token_hooks import TokenHooks
from gradloc.config import PrecursorConfig
from tests.helpers import backward_step, make_data, single_thread, tiny_gpt  # noqa: F401

DET = gradloc.DetectorConfig(warmup=3)
STEPS, SPIKE, PLANT = 6, 5, (1, 2, 5)  # step, (micro-batch, sample, position)


def _compile(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """What the training loop calls: the compiled wrapper (whole) or the model with compiled blocks."""
    if how == "whole":
        return torch.compile(model)
    for block in model.blocks:
        block.compile(fullgraph=True)  # torchtitan's way: each block one graph, no break allowed
    return model


def _scores(model: torch.nn.Module, run: torch.nn.Module, data) -> torch.Tensor:  # noqa: ANN001
    """(L, B, T) per-layer scores of micro-batch (0, 0) through ``run`` (hooks on ``model``)."""
    hooks = TokenHooks(model, module_layer_map(model, "module"))
    hooks.attach()
    try:
        for _ in range(2):  # the first compiled call traces before gradloc knows: it asks for sinks
            hooks.begin(0, *data.y[0, 0].shape)
            data.loss(run, 0, 0).backward()
            buf = hooks.end()
            buf.fold(hooks.watched)
            model.zero_grad()
        return buf.rows()[2]
    finally:
        hooks.detach()


@pytest.mark.parametrize("how", ["whole", "blocks"])
def test_compiled_scores_equal_the_eager_hooks(how):
    torch._dynamo.reset()
    data = make_data(1, 1)
    plain = tiny_gpt(0)
    eager = _scores(plain, plain, data)
    model = tiny_gpt(0)
    counters.clear()
    compiled = _scores(model, _compile(model, how), data)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert compiled.shape == eager.shape and (eager.sum((1, 2)) > 0).all()  # every layer scored
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-9)


def _train(how: str, order: str, monitor: bool) -> dict:
    torch._dynamo.reset()
    model = tiny_gpt(0)
    data = make_data(STEPS, 2)
    data.w[(SPIKE, *PLANT)] = 3000.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = _compile(model, how) if order == "compile_first" else model
    mon = gradloc.watch(run, opt, detector=DET, store=False) if monitor else None
    if order == "watch_first":
        run = _compile(model, how)
    counters.clear()
    reports = []
    for s in range(STEPS):
        total = backward_step(run, data, s, mon)
        if mon is not None:
            reports.append(mon.end_step(total, probe=lambda i, mask=None, s=s: data.loss(run, s, i, mask=mask)))
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.close()
    return {"reports": reports, "breaks": dict(counters["graph_break"]),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("how,order", [("whole", "compile_first"), ("whole", "watch_first"),
                                       ("blocks", "compile_first"), ("blocks", "watch_first")])
def test_a_compiled_model_is_watched_and_localized_and_trains_bitwise_the_same(how, order):
    watched, plain = _train(how, order, True), _train(how, order, False)
    assert watched["breaks"] == {}
    for rep in watched["reports"][1:]:  # after the first micro-batch's trace: every watched module scored
        assert rep.record.tokens is not None and rep.record.tokens.unattributed_share == 0.0
    rep = watched["reports"][SPIKE]
    loc = rep.incident.localization
    assert (loc.status, loc.level) == ("located", "token") and 1 <= loc.probes <= 3, loc.note
    assert [(c.micro_batch, c.sample, c.position) for c in loc.culprits] == [PLANT]
    assert all(r.incident is None for r in watched["reports"][:SPIKE])
    for name, p in plain["params"].items():
        assert torch.equal(p, watched["params"][name]), name


def test_a_model_compiled_and_run_before_watch_is_retraced_with_the_hooks_and_said_once(caplog):
    """torch.compile keeps a graph traced before gradloc's hooks existed (pytorch#117758): dynamo does not guard
    on empty hook dicts by default. watch() turns those guards on and drops the graphs traced without them
    (said once, collector/compiled.py guard_hooks), so the model retraces with the taps: every watched module
    scored from the second micro-batch on, nothing silent. (Before: no hook ran, all unattributed.)"""
    torch._dynamo.reset()
    model = tiny_gpt(0)
    data = make_data(3, 2)
    run = torch.compile(model)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):  # torch's default (an earlier watch() set it)
        data.loss(run, 0, 0).backward()  # compiled and run without hooks
        model.zero_grad()
        with caplog.at_level(logging.WARNING, logger="gradloc"):
            mon = gradloc.watch(run, detector=DET, store=False)
            for s in range(3):
                total = backward_step(run, data, s, mon)
                rep = mon.end_step(total)
    warned = [r for r in caplog.records if "traced before watch() did not guard" in r.getMessage()]
    assert len(warned) == 1
    assert not mon.counters["silent_micro_batches"] and not mon.counters["untapped_micro_batches"]
    assert rep.record.tokens is not None and rep.record.tokens.unattributed_share == 0.0
    assert rep.record.layers and all(s.grad_norm > 0 for s in rep.record.layers)
    mon.close()


def test_where_the_stale_graph_cannot_be_dropped_it_is_said_once_and_nothing_is_guessed(caplog, monkeypatch):
    """A torch without the means to drop graphs (guard_hooks answers -1): the graph traced before watch() runs
    without any hook. gradloc warns once, reports every watched module's gradient as unattributed, names nobody.
    (Attention precursors off: their SDPA wrapper, collector/precursors/compiled.py, is a new global for dynamo and
    would itself retrace a graph that calls SDPA.)"""
    from gradloc.collector import compiled

    monkeypatch.setattr(compiled, "guard_hooks", lambda *a: -1)
    torch._dynamo.reset()
    model = tiny_gpt(0)
    data = make_data(3, 2)
    run = torch.compile(model)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        data.loss(run, 0, 0).backward()  # compiled and run without hooks
        model.zero_grad()
        mon = gradloc.watch(run, detector=DET, store=False, precursors=PrecursorConfig(attention=False))
        with caplog.at_level(logging.WARNING, logger="gradloc"):
            for s in range(3):
                total = backward_step(run, data, s, mon)
                rep = mon.end_step(total)
    warned = [r for r in caplog.records if "no watched module's forward hook ran" in r.getMessage()]
    assert len(warned) == 1 and "torch._dynamo.reset()" in warned[0].getMessage()
    assert mon.counters["silent_micro_batches"] == 6
    assert rep.record.tokens is not None and rep.record.tokens.unattributed_share == pytest.approx(1.0)
    assert rep.record.layers and all(s.grad_norm > 0 for s in rep.record.layers)  # per-layer statistics go on
    mon.close()


def test_an_hf_llama_compiled_per_block_with_fullgraph_is_localized():
    """Each LlamaDecoderLayer compiled with fullgraph=True (torchtitan's recipe on an HF model): every
    module scored (nothing unattributed), no graph break, the planted token located within 3 probes."""
    pytest.importorskip("transformers")
    from bench.models import QUICK, build_model, logits
    from gradloc.demo.model import token_losses

    torch._dynamo.reset()
    cfg = QUICK["llama"]
    model = build_model(cfg, 0)
    g = torch.Generator().manual_seed(0)
    steps, spike = 6, 5
    toks = torch.randint(cfg.vocab, (steps, 2, 2, 33), generator=g)
    x, y = toks[..., :-1], toks[..., 1:]
    w = torch.ones(steps, 2, 2, 32)
    w[spike, 1, 1, 7] = 3000.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, detector=DET, store=False)
    for layer in model.model.layers:
        layer.compile(fullgraph=True)
    counters.clear()

    def loss(s, i, mask=None):
        terms = token_losses(logits(model, x[s, i]), y[s, i]) * w[s, i]
        return (terms if mask is None else terms * mask).sum() / (terms.numel() * 2)

    reports = []
    for s in range(steps):
        total = torch.zeros(())
        for i in range(2):
            with mon.micro_batch(y[s, i]):
                li = loss(s, i)
                li.backward()
            total += li.detach()
        reports.append(mon.end_step(total, probe=lambda i, mask=None, s=s: loss(s, i, mask)))
        opt.step()
        opt.zero_grad()
    mon.close()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(r.record.tokens.unattributed_share == 0.0 for r in reports[1:])
    loc = reports[spike].incident.localization
    assert loc.status == "located" and loc.probes <= 3, loc.note
    assert [(c.micro_batch, c.sample, c.position) for c in loc.culprits][:1] == [(1, 1, 7)]
