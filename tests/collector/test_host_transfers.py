"""A healthy step costs one device->host transfer, whatever the number of parameters or tokens.

On CPU a transfer cannot be observed directly, so every Tensor method that forces one (.cpu,
.item, .tolist, .numpy, int/float/bool of a tensor) is counted while end_step runs.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

import gradloc
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses

_SYNCING = ("cpu", "item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def count_syncs(monkeypatch: pytest.MonkeyPatch):
    counts: Counter[str] = Counter()
    for name in _SYNCING:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *a, __original=original, __name=name, **k):
            counts[__name] += 1
            return __original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    yield counts
    monkeypatch.undo()


@pytest.mark.parametrize("n_layers", [1, 3])
def test_a_healthy_step_does_one_transfer(monkeypatch: pytest.MonkeyPatch, n_layers: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, seq=16, d_model=32, n_layers=n_layers))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    never = dict(z_threshold=1e9, layer_z_threshold=1e9, loss_z_threshold=1e9, token_z_threshold=1e9)
    mon = gradloc.watch(model, opt, detector=gradloc.DetectorConfig(warmup=3, **never))
    data = torch.randint(0, 64, (6, 2, 4, 17))
    per_step = []
    for step in range(6):
        loss = torch.zeros(())
        for i in range(2):
            x, y = data[step, i, :, :-1], data[step, i, :, 1:]
            with mon.micro_batch(y, sample_ids=list("abcd")):
                part = token_losses(model(x), y).mean() / 2
                part.backward()
            loss += part.detach()
        with count_syncs(monkeypatch) as counts:
            report = mon.end_step(loss)
        opt.step()
        opt.zero_grad()
        assert report.spike.kinds == ()  # healthy steps: the spike path is allowed more transfers
        per_step.append(dict(counts))
    mon.close()
    for counts in per_step:
        # the packed transfer (.cpu(), then .numpy() of that host copy); nothing per layer or token
        assert counts == {"cpu": 1, "numpy": 1}, counts
    assert all(tok.token_id is not None and tok.sample_id in "abcd" for tok in report.record.tokens.top)
