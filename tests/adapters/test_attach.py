"""watch()/detach() leave the model and optimizer exactly as they were; the JSONL incident sink."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import gradloc
from gradloc.exporters import read_incidents

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.helpers` under plain `pytest` too
from tests.helpers import (  # noqa: E402
    backward_step,
    make_data,
    single_thread,  # noqa: E402,F401 (autouse fixture)
    tiny_gpt,
    train,
)

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")
OPT_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")


def _structure(model: torch.nn.Module) -> dict[str, tuple]:
    """Per module: its attribute names and the keys of every hook dict (hooks are keyed by handle id)."""
    return {name: (tuple(sorted(vars(m))), tuple((h, tuple(getattr(m, h, {}))) for h in HOOK_DICTS))
            for name, m in model.named_modules()}


def _assert_no_hooks(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    for name, m in model.named_modules():
        for h in HOOK_DICTS:
            assert len(getattr(m, h, {})) == 0, f"{name}.{h} still holds a hook"
    if opt is not None:
        for h in OPT_HOOKS:
            assert len(getattr(opt, h)) == 0, f"optimizer.{h} still holds a hook"


def _n_forward_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_attach_then_detach_leaves_model_and_optimizer_unchanged():
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for h in OPT_HOOKS:  # the attribute names this test relies on exist in this torch
        assert isinstance(getattr(opt, h), dict)
    structure = _structure(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_vars = sorted(vars(opt))
    _assert_no_hooks(model, opt)

    mon = gradloc.watch(model, opt)
    assert mon.attached
    # sanity: the checks below would see gradloc's hooks — the token hooks', and the precursor hooks' discovery ones
    # (a pre- and a post-hook on every module until the first micro-batch has run)
    n_modules = len(list(model.modules()))
    assert _n_forward_hooks(model) == len(mon.hooks.watched) + n_modules and mon.hooks.watched
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == n_modules
    assert all(len(getattr(opt, h)) == 1 for h in OPT_HOOKS)
    mon.detach()

    assert not mon.attached
    _assert_no_hooks(model, opt)
    assert _structure(model) == structure
    after = model.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[k], v) for k, v in state.items())
    assert sorted(vars(opt)) == opt_vars
    assert opt.state_dict()["state"] == {}
    with pytest.raises(gradloc.AttachError):
        mon.detach()  # detaching twice is a wiring mistake


def test_training_then_close_leaves_no_hooks():
    model = tiny_gpt(0, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(8, 2)
    data.plant(6, 0, 0, 3)  # a spike, so probes (which move gradients aside) run too
    structure = _structure(model)
    mon = gradloc.watch(model, opt, detector=gradloc.DetectorConfig(warmup=5))
    reports = train(model, opt, data, mon)
    assert reports[6].incident.localization.probes >= 1
    mon.close()
    _assert_no_hooks(model, opt)
    assert _structure(model) == structure
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none) after the last step


def test_attaching_twice_raises_and_reattach_after_detach_works():
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(2, 2)
    first = gradloc.watch(model, opt)
    n_hooks = _n_forward_hooks(model)
    with pytest.raises(gradloc.AttachError):
        gradloc.watch(model, opt)
    with pytest.raises(gradloc.AttachError):
        first.attach()
    # the failed attempts added nothing and the first monitor still works
    assert _n_forward_hooks(model) == n_hooks
    assert all(len(getattr(opt, h)) == 1 for h in OPT_HOOKS)
    train(model, opt, data, first, steps=1)
    first.detach()
    _assert_no_hooks(model, opt)

    second = gradloc.watch(model, opt)
    assert _n_forward_hooks(model) == n_hooks
    total = backward_step(model, data, 1, second)
    rec = second.end_step(total).record
    assert rec.tokens is not None and rec.tokens.total_score > 0
    assert rec.global_norm > 0
    opt.step()
    second.close()
    _assert_no_hooks(model, opt)
    assert len(second.history) == 1 and second.history[0].layers[0].update_ratio is not None  # the first window's
    assert first.step == 1 and len(first.history) == 0  # detach() alone keeps the last record pending
    first.close()  # close() after detach() emits it and does not touch the model again
    assert [r.step for r in first.history] == [0]
    _assert_no_hooks(model, opt)


def test_context_manager_closes_and_detaches():
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(2, 2)
    with gradloc.watch(model, opt) as mon:
        assert mon.attached and _n_forward_hooks(model) > 0
        train(model, opt, data, mon, steps=2)
        assert len(mon.history) == 1  # the last record waits for its update ratio
    assert not mon.attached
    # close() flushed the last record with the ratios of the layers its step's window covered (lean: a quarter)
    assert len(mon.history) == 2 and any(x.update_ratio is not None for x in mon.history[-1].layers
                                         if x.param_norm > 0)
    _assert_no_hooks(model, opt)
    # an exception inside the block detaches as well
    with pytest.raises(KeyError):
        with gradloc.watch(model, opt) as mon2:
            raise KeyError("boom")
    assert not mon2.attached
    _assert_no_hooks(model, opt)
    gradloc.watch(model, opt).close()


def test_jsonl_incident_sink(tmp_path):
    path = tmp_path / "inc.jsonl"
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(11, 2)
    planted = {6: data.plant(6, 1, 2, 4), 9: data.plant(9, 0, 3, 12)}
    mon = gradloc.watch(model, opt, config=gradloc.WatchConfig(
        incident_path=str(path), job="job-a",
        detector=gradloc.DetectorConfig(warmup=5, sensitivity="zclip")))  # every spike its own incident (no episodes)
    reports = train(model, opt, data, mon)
    mon.close()
    spikes = [r for r in reports if r.spike.is_spike]
    assert {r.record.step for r in spikes} >= set(planted)
    assert all(r.incident is not None for r in spikes)
    assert all(r.incident is None for r in reports if not r.spike.is_spike)

    rows = read_incidents(path)
    assert len(rows) == len(spikes) == len(mon.incidents)  # one line per spike
    assert [r["incident_id"] for r in rows] == [i.incident_id for i in mon.incidents]
    by_step = {r["step"]: r for r in rows}
    for step, (mb, b, t) in planted.items():
        row = by_step[step]
        assert row["kind"] == "incident" and row["schema_version"] == 1
        assert row["job"] == "job-a" and row["rank"] == 0
        assert "grad_spike" in row["spike"]["kinds"]
        loc = row["localization"]
        assert loc["status"] == "located" and loc["probes"] >= 1
        top = loc["culprits"][0]
        assert (top["micro_batch"], top["sample"], top["position"]) == (mb, b, t)
        assert top["token_id"] == int(data.y[step, mb, b, t])
        assert row["top_layers"] and "grad_norm" in row["top_layers"][0]


def test_failed_attach_does_not_leak_an_open_incident_file(tmp_path, monkeypatch):
    from gradloc.exporters import jsonl as adapter

    opened = []

    class RecordingSink(adapter.JsonlSink):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            opened.append(self)

    monkeypatch.setattr(adapter, "JsonlSink", RecordingSink)
    model = tiny_gpt(0)
    first = gradloc.watch(model, incident_path=str(tmp_path / "a.jsonl"))
    with pytest.raises(gradloc.AttachError):
        gradloc.watch(model, incident_path=str(tmp_path / "b.jsonl"))
    first.close()
    assert all(s._fh is None for s in opened), "a sink of the failed watch() is still open"
