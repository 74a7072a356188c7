"""A compiled watched model among other compiled models (collector/compiled.py, ``guard_hooks``): a
reference policy of the same class, an EMA copy, a teacher of another class that shares the block
class, compiled before or after ``watch`` and called before or after the watched model. Dynamo caches
a graph per code object (a class's ``forward``) and by default does not guard on empty hook dicts, so
before the fix the other instance's graph (traced without gradloc's hooks) ran for the watched model:
every step 100 % unattributed, a planted token "located" by bisection. Also: activation checkpointing
inside a ``fullgraph=True`` region, and a graph that still runs without the taps, which is said.
The other model runs with autograd on (a reference or critic computed outside ``no_grad``): under
``no_grad`` dynamo's grad-mode guard already kept the graphs apart. Backend ``aot_eager`` (the cache
and guards are dynamo's, the same for every backend; inductor on CPU is slow to compile)."""
from __future__ import annotations

import contextlib
import copy
import functools
import logging

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import gradloc
from gradloc.demo.model import TinyGPT
from tests.helpers import backward_step, make_data, single_thread, tiny_gpt  # noqa: F401

DET = gradloc.DetectorConfig(warmup=3)
STEPS, SPIKE, PLANT = 6, 5, (1, 2, 5)  # step, (micro-batch, sample, position)
BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts as a new process does: no graph, dynamo's default of no guard on empty hook dicts
    (a monitor attached by an earlier test turned those guards on for the process)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        yield
    torch._dynamo.reset()


class Teacher(TinyGPT):
    """Another class with TinyGPT's blocks (a distillation teacher): per-block compile shares Block.forward."""


def _compile(model: torch.nn.Module, how: str, fullgraph: bool = False) -> torch.nn.Module:
    if how == "whole":
        return torch.compile(model, backend=BACKEND, fullgraph=fullgraph)
    for block in model.blocks:
        block.compile(backend=BACKEND, fullgraph=True)
    return model


def _train(case: str, monitor: bool, order: str = "after", how: str | None = None) -> dict:
    """The watched TinyGPT (whole-model or per-block compile) trained STEPS steps with a planted token, beside
    ``case``: "reference" (a second TinyGPT, whole), "ema" (copy.deepcopy of the model after watch: it
    inherits the hooks; whole), "teacher" (Teacher, 3 blocks, per block). ``order``: "before" = the other
    model compiled and called before watch and before the watched model's first call, each step first;
    "after" = compiled after watch, called after the watched model's step."""
    torch._dynamo.reset()
    model = tiny_gpt(0)
    data = make_data(STEPS, 2)
    data.w[(SPIKE, *PLANT)] = 3000.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    how = how or ("blocks" if case == "teacher" else "whole")
    other_model = {"reference": lambda: tiny_gpt(1), "ema": lambda: None, "teacher": _teacher,
                   "none": lambda: None}[case]()
    other = None

    def call_other(s: int) -> None:
        other(data.x[s, 0]).sum().backward()  # autograd on: a reference/critic outside no_grad
        for p in other_model.parameters():
            p.grad = None

    if order == "before" and other_model is not None:
        other = _compile(other_model, "blocks" if case == "teacher" else "whole")
        call_other(0)
    run = _compile(model, how)
    mon = gradloc.watch(run, opt, detector=DET, store=False) if monitor else None
    if case == "ema":
        other_model = copy.deepcopy(model)  # after watch: the copy carries gradloc's hooks (not watched)
    if other is None and other_model is not None:
        other = _compile(other_model, "blocks" if case == "teacher" else "whole")
    counters.clear()
    reports = []
    for s in range(STEPS):
        if order == "before":
            call_other(s)
        if order == "inside":  # inside each micro-batch block, after the watched model's backward
            total = torch.zeros(())
            for i in range(data.micro):
                with mon.micro_batch(data.y[s, i]) if mon is not None else contextlib.nullcontext():
                    loss = data.loss(run, s, i)
                    loss.backward()
                    call_other(s)
                total += loss.detach()
        else:
            total = backward_step(run, data, s, mon)
        if order == "after" and other is not None:
            call_other(s)
        if mon is not None:
            reports.append(mon.end_step(total, probe=lambda i, mask=None, s=s: data.loss(run, s, i, mask=mask)))
        opt.step()
        opt.zero_grad()
        if case == "ema":
            with torch.no_grad():
                for e, p in zip(other_model.parameters(), model.parameters()):
                    e.lerp_(p, 0.1)
    out = {"reports": reports, "breaks": dict(counters["graph_break"]),
           "counters": dict(mon.counters) if mon is not None else {},
           "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    if mon is not None:
        mon.close()
    return out


def _teacher() -> Teacher:
    student = tiny_gpt(2, n_layers=3)
    teacher = Teacher(student.cfg)
    teacher.load_state_dict(student.state_dict())
    return teacher


@functools.cache
def _alone(how: str) -> list[float]:
    """The watched run's per-step total token score with no other model in the process."""
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        return [r.record.tokens.total_score for r in _train("none", True, "after", how)["reports"]]


@pytest.mark.parametrize("case,order", [("reference", "before"), ("reference", "after"), ("ema", "after"),
                                        ("ema", "inside"), ("teacher", "before"), ("teacher", "after")])
def test_the_watched_model_keeps_its_capture_beside_other_compiled_models(case, order):
    """Scored as if alone (the same per-token scores every step: the other model's gradient never reaches
    the watched model's sinks, a deepcopy's inherited hooks included), located in ≤ 3 probes, bitwise."""
    watched, plain = _train(case, True, order), _train(case, False, order)
    alone = _alone("blocks" if case == "teacher" else "whole")
    assert [r.record.tokens.total_score for r in watched["reports"]] == pytest.approx(alone, rel=1e-6)
    assert watched["breaks"] == {}
    assert not watched["counters"].get("untapped_micro_batches") and not watched["counters"].get("silent_micro_batches")
    for rep in watched["reports"][1:]:  # every watched module scored, every step
        assert rep.record.tokens is not None and rep.record.tokens.unattributed_share == 0.0, rep.record.step
    loc = watched["reports"][SPIKE].incident.localization
    assert (loc.status, loc.level) == ("located", "token") and 1 <= loc.probes <= 3, loc.note
    assert [(c.micro_batch, c.sample, c.position) for c in loc.culprits] == [PLANT]
    assert all(r.incident is None for r in watched["reports"][:SPIKE])
    for name, p in plain["params"].items():  # training unchanged by gradloc in the same set-up
        assert torch.equal(p, watched["params"][name]), name


def test_graphs_traced_before_watch_are_dropped_and_said_once(caplog):
    """The reference compiled and run before watch: its graph (no hook guards) is dropped at watch, said once."""
    with caplog.at_level(logging.WARNING, logger="gradloc"):
        _train("reference", True, "before")
    said = [r.getMessage() for r in caplog.records if "traced before watch() did not guard" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("gradloc: 1 compiled graph(s)"), said


def test_a_graph_without_the_taps_is_said_at_once_counted_and_unattributed(caplog):
    """Where the capture cannot be kept — here dynamo's hook guards are turned off again after watch (a
    library resetting dynamo's config), so the reference's graph runs for the watched model — gradloc warns
    once, counts each such micro-batch and reports the step's gradient as unattributed: never silently."""
    torch._dynamo.reset()
    model, ref = tiny_gpt(0), tiny_gpt(1)
    data = make_data(3, 2)
    run, ref_run = _compile(model, "whole"), _compile(ref, "whole")
    mon = gradloc.watch(run, detector=DET, store=False)
    backward_step(run, data, 0, mon)  # traced with the taps
    mon.end_step(torch.ones(()))
    torch._dynamo.config.skip_nnmodule_hook_guards = True  # (restored by the fixture)
    with caplog.at_level(logging.WARNING, logger="gradloc"):
        for s in range(1, 3):
            ref_run(data.x[s, 0]).sum().backward()  # traced now, without hook guards: it runs for `run` too
            total = backward_step(run, data, s, mon)
            rep = mon.end_step(total)
    said = [r for r in caplog.records if "ran a compiled graph without gradloc's taps" in r.getMessage()]
    assert len(said) == 1 and "untapped_micro_batches" in said[0].getMessage()
    assert mon.counters["untapped_micro_batches"] == 4
    assert rep.record.tokens is not None and rep.record.tokens.unattributed_share == pytest.approx(1.0)
    assert rep.record.layers and all(s.grad_norm > 0 for s in rep.record.layers)  # per-layer statistics go on
    mon.close()


def _checkpointed(model: TinyGPT) -> TinyGPT:
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


@pytest.mark.parametrize("checkpointed,fullgraph", [(True, False), (True, True), (False, True)])
def test_checkpointed_blocks_inside_a_compiled_model_are_scored_and_localized(checkpointed, fullgraph):
    """torch.utils.checkpoint (non-reentrant) around each block, the model compiled whole (with fullgraph=True:
    no graph break allowed): the checkpointed body is a higher-order op whose trace refuses Python side
    effects; the taps inside it store nothing. Before, fullgraph=True raised dynamo's "Non-nullified side
    effect" into the training loop. Scores equal the eager hooks', the token located, training bitwise. Also the
    issue's bad input, a whole model compiled with fullgraph=True: it takes the capture (nothing to refuse)."""
    from tests.collector.test_compiled import _scores

    data = make_data(1, 1)
    plain = tiny_gpt(0)
    eager = _scores(plain, plain, data)
    model = _checkpointed(tiny_gpt(0)) if checkpointed else tiny_gpt(0)
    torch._dynamo.reset()
    counters.clear()
    got = _scores(model, _compile(model, "whole", fullgraph), data)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-9)

    runs = []
    for monitor in (True, False):
        torch._dynamo.reset()
        model = _checkpointed(tiny_gpt(0)) if checkpointed else tiny_gpt(0)
        data = make_data(STEPS, 2)
        data.w[(SPIKE, *PLANT)] = 3000.0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = _compile(model, "whole", fullgraph)
        mon = gradloc.watch(run, opt, detector=DET, store=False) if monitor else None
        reports = []
        for s in range(STEPS):
            total = backward_step(run, data, s, mon)
            if mon is not None:
                reports.append(mon.end_step(total, probe=lambda i, mask=None, s=s: data.loss(run, s, i, mask=mask)))
            opt.step()
            opt.zero_grad()
        if mon is not None:
            mon.close()
        runs.append((reports, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (reports, watched), (_, plain_params) = runs
    assert all(r.record.tokens.unattributed_share == 0.0 for r in reports[1:])
    loc = reports[SPIKE].incident.localization
    assert loc.status == "located" and loc.probes <= 3, loc.note
    assert [(c.micro_batch, c.sample, c.position) for c in loc.culprits] == [PLANT]
    for name, p in plain_params.items():
        assert torch.equal(p, watched[name]), name


def test_many_blocks_compiled_one_by_one_with_fullgraph_train_and_are_scored():
    """torchtitan's per-block fullgraph compile on 10 blocks: each block's taps read its own sink, so each block
    instance traces once — past dynamo's recompile_limit of 8 per code object, which under fullgraph=True
    failed the step (FailOnRecompileLimitHit) before gradloc raised the limit for the watched blocks."""
    model = tiny_gpt(0, n_layers=10)
    data = make_data(3, 2)
    mon = gradloc.watch(model, detector=DET, store=False)
    for block in model.blocks:
        block.compile(backend=BACKEND, fullgraph=True)
    reports = [mon.end_step(backward_step(model, data, s, mon)) for s in range(3)]
    mon.close()
    assert all(r.record.tokens.unattributed_share == 0.0 for r in reports[1:])
    assert torch._dynamo.config.recompile_limit >= 10 + 8
