"""``token_stats="on_spike"`` (engine/on_spike.py): no module hook on healthy steps; a flagged step's
micro-batches re-run with the hooks for its per-token statistics — the same localization as the
always-on hooks, the re-run passes counted apart, training bitwise unchanged, eager and compiled."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import gradloc
from tests.helpers import backward_step, make_data, single_thread, tiny_gpt  # noqa: F401

DET = gradloc.DetectorConfig(warmup=3)
STEPS, SPIKE, PLANT = 7, 6, (1, 2, 5)


def _train(token_stats, compiled: bool = False, probe_fails: bool = False) -> dict:
    torch._dynamo.reset()
    model = tiny_gpt(0)
    data = make_data(STEPS, 2)
    data.w[(SPIKE, *PLANT)] = 3000.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, detector=DET, store=False, token_stats=token_stats) \
        if token_stats is not None else None
    run = torch.compile(model) if compiled else model
    counters.clear()
    reports, hooks = [], []

    def probe(s: int):
        def closure(i: int, mask: torch.Tensor | None = None) -> torch.Tensor:
            if probe_fails:
                raise RuntimeError("the user's closure broke")
            return data.loss(run, s, i, mask=mask)
        return closure

    for s in range(STEPS):
        hooks.append(sum(len(m._forward_hooks) for m in model.modules()))
        total = backward_step(run, data, s, mon)
        if mon is not None:
            reports.append(mon.end_step(total, probe=probe(s)))
        opt.step()
        opt.zero_grad()
    out = {"reports": reports, "hooks": hooks, "breaks": dict(counters["graph_break"]),
           "params": {n: p.detach().clone() for n, p in model.named_parameters()},
           "counters": dict(mon.counters) if mon else {}}
    if mon is not None:
        mon.close()
        out["hooks_after"] = sum(len(m._forward_hooks) for m in model.modules())
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_healthy_steps_run_no_hook_and_a_spike_is_localized_as_with_the_hooks(compiled):
    always, lazy, plain = _train(True, compiled), _train("on_spike", compiled), _train(None, compiled)
    assert set(lazy["hooks"]) == {0} and min(always["hooks"]) > 0  # no module hook while training
    assert lazy["hooks_after"] == 0 and lazy["breaks"] == {}
    assert all(r.record.tokens is None for r in lazy["reports"])  # no per-token statistics on any step
    assert [r.incident is not None for r in lazy["reports"]] == [s == SPIKE for s in range(STEPS)]
    a, b = always["reports"][SPIKE].incident.localization, lazy["reports"][SPIKE].incident.localization
    assert (b.status, b.level, b.probes) == (a.status, a.level, a.probes) == ("located", "token", 1)
    assert [(c.micro_batch, c.sample, c.position) for c in b.culprits] == [PLANT]
    assert b.explained_share == pytest.approx(a.explained_share, rel=1e-6)
    assert b.culprits[0].score_share == pytest.approx(a.culprits[0].score_share, rel=1e-4)  # the re-run's scores
    assert b.passes == a.passes + 2 and b.note.startswith("on_spike: the step's 2 micro-batch(es) re-run")
    for name, p in plain["params"].items():  # the re-runs and probes leave training bitwise unchanged
        assert torch.equal(p, lazy["params"][name]) and torch.equal(p, always["params"][name]), name


def test_a_failing_re_run_leaves_the_step_without_per_token_statistics_and_training_goes_on():
    out = _train("on_spike", probe_fails=True)
    loc = out["reports"][SPIKE].incident.localization
    assert (loc.status, loc.probes, loc.culprits) == ("unavailable", 0, ())
    assert out["counters"]["on_spike_rerun_failed"] == 1 and out["hooks_after"] == 0
    assert all(torch.isfinite(p).all() for p in out["params"].values())


def test_token_stats_takes_true_false_or_on_spike():
    with pytest.raises(gradloc.ConfigError, match="token_stats must be True, False or 'on_spike'"):
        gradloc.WatchConfig(token_stats="sometimes")
