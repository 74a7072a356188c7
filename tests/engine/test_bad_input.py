"""Wiring mistakes get a typed, informative error at setup, never a crash inside backward; hot-path
problems (after the first step, or with strict=False) are counted and dropped instead."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradloc
from gradloc.demo.model import GPTConfig, TinyGPT

B, T, V = 3, 5, 11


def _token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    b, t, v = logits.shape
    return nn.functional.cross_entropy(logits.reshape(b * t, v), targets.reshape(b * t), reduction="none").view(b, t)


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab=V, seq=8, d_model=8, n_layers=1, n_heads=2))


def _batch(b: int = B, t: int = T):
    return torch.randint(0, V, (b, t)), torch.randint(0, V, (b, t))


@pytest.fixture
def model():
    return _model()


@pytest.fixture
def mon(model):
    m = gradloc.watch(model, config=gradloc.WatchConfig(update_ratio=False))
    yield m
    if m.attached:
        m.close()


def _assert_block_not_opened(mon):
    assert mon._parts == [] and mon.hooks.current is None


# -- metadata validated when the block opens ---------------------------------------------------------
@pytest.mark.parametrize("mask", [torch.ones(B, T + 1, dtype=torch.bool), torch.ones(B * T, dtype=torch.bool),
                                  [[1] * T] * B])
def test_wrong_loss_mask_shape(mon, mask):
    ids, _ = _batch()
    with pytest.raises(gradloc.BatchMetadataError, match=r"loss_mask must have shape \(3, 5\)"):
        with mon.micro_batch(ids, loss_mask=mask):
            pytest.fail("the block body must not run")
    _assert_block_not_opened(mon)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_non_integer_token_ids(mon, dtype):
    ids, _ = _batch()
    with pytest.raises(gradloc.BatchMetadataError, match="integer tensor.*dtype"):
        with mon.micro_batch(ids.to(dtype)):
            pytest.fail("the block body must not run")
    _assert_block_not_opened(mon)


@pytest.mark.parametrize("bad", [torch.zeros(B * T, dtype=torch.long), [[1, 2, 3]], torch.zeros(1, B, T, dtype=torch.long)])
def test_token_ids_not_2d_tensor(mon, bad):
    with pytest.raises(gradloc.BatchMetadataError, match=r"2-D \(batch, seq\)"):
        with mon.micro_batch(bad):
            pass


@pytest.mark.parametrize("n", [B - 1, B + 1])
def test_sample_ids_of_wrong_length(mon, n):
    ids, _ = _batch()
    with pytest.raises(gradloc.BatchMetadataError, match=f"sample_ids has {n} entries.* {B} samples"):
        with mon.micro_batch(ids, sample_ids=[f"doc{i}" for i in range(n)]):
            pass
    _assert_block_not_opened(mon)


def test_neither_token_ids_nor_shape(mon):
    with pytest.raises(gradloc.BatchMetadataError, match="shape="):
        with mon.micro_batch():
            pass


def test_monitor_still_works_after_a_rejected_block(mon, model):
    ids, targets = _batch()
    with pytest.raises(gradloc.BatchMetadataError):
        with mon.micro_batch(targets, sample_ids=["only-one"]):
            pass
    with mon.micro_batch(targets, sample_ids=[f"s{i}" for i in range(B)]):
        _token_ce(model(ids), targets).mean().backward()
    rec = mon.end_step().record
    assert rec.micro_batches == 1 and rec.tokens.tokens == B * T and rec.tokens.top[0].sample_id.startswith("s")


# -- token ids that do not describe the batch the model runs -----------------------------------------
@pytest.mark.parametrize("ids_shape", [(B - 1, T), (B, T + 2), (1, 1)])
def test_mismatched_token_ids_raise_at_block_exit_on_first_step(mon, model, ids_shape):
    ids, targets = _batch()
    wrong = torch.randint(0, V, ids_shape)
    ran = []
    with pytest.raises(gradloc.BatchMetadataError, match=rf"\({ids_shape[0]}, {ids_shape[1]}\).*no watched module"):
        with mon.micro_batch(wrong):
            _token_ce(model(ids), targets).mean().backward()  # backward itself must not fail
            ran.append(True)
    assert ran == [True]
    assert model.head.weight.grad is not None  # the user's backward completed normally


def test_mismatched_token_ids_non_strict_counts_a_drop(model):
    mon = gradloc.watch(model, config=gradloc.WatchConfig(strict=False, update_ratio=False))
    try:
        ids, targets = _batch()
        with mon.micro_batch(torch.randint(0, V, (B + 1, T))):
            _token_ce(model(ids), targets).mean().backward()
        assert mon.counters["dropped_micro_batches"] == 1
        report = mon.end_step()
        rec = report.record
        assert rec.tokens is not None and rec.tokens.dropped_calls > 0
        assert rec.tokens.total_score == 0.0  # nothing was attributed to the wrong positions
        assert rec.global_norm > 0  # per-layer statistics are unaffected
    finally:
        mon.close()


def test_mismatch_after_first_step_is_counted_even_in_strict_mode(mon, model):
    ids, targets = _batch()
    with mon.micro_batch(targets):
        _token_ce(model(ids), targets).mean().backward()
    mon.end_step()
    model.zero_grad()
    with mon.micro_batch(torch.randint(0, V, (B, T + 1))):  # no exception on the hot path
        _token_ce(model(ids), targets).mean().backward()
    assert mon.counters["dropped_micro_batches"] == 1
    assert mon.end_step().record.tokens.dropped_calls > 0


def test_mismatched_token_ids_with_same_token_count_raise(mon, model):
    ids, targets = _batch(2, 6)
    with pytest.raises(gradloc.BatchMetadataError):
        with mon.micro_batch(torch.randint(0, V, (3, 4))):  # 12 tokens, like the (2, 6) batch
            _token_ce(model(ids), targets).mean().backward()


# -- unsupported models ----------------------------------------------------------------------------
class ConvOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.conv2 = nn.Conv1d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv(x)))


def test_model_without_supported_layers():
    model = ConvOnly()
    with pytest.raises(gradloc.UnsupportedModelError, match=r"ConvOnly has no module with a per-token rule.*token_stats=False"):
        gradloc.watch(model)
    mon = gradloc.watch(model, config=gradloc.WatchConfig(token_stats=False))  # a failed watch left nothing attached
    try:
        assert mon.hooks is None
        with mon.micro_batch(shape=(2, 7)):
            model(torch.randn(2, 4, 7)).pow(2).mean().backward()
        rec = mon.end_step(0.5).record
        assert rec.tokens is None and rec.global_norm > 0 and {s.layer for s in rec.layers} == {"conv", "conv2"}
    finally:
        mon.close()


def test_frozen_only_supported_layers_count_as_unsupported():
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 1))
    model[0].requires_grad_(False)
    with pytest.raises(gradloc.UnsupportedModelError, match="per-token rule"):
        gradloc.watch(model)


def test_model_without_trainable_parameters():
    with pytest.raises(gradloc.UnsupportedModelError, match="trainable"):
        gradloc.watch(nn.Linear(3, 3).requires_grad_(False))


def test_not_a_module():
    with pytest.raises(gradloc.UnsupportedModelError, match="nn.Module.*function"):
        gradloc.watch(lambda x: x)


# -- attach / detach order ---------------------------------------------------------------------------
def test_attaching_twice(model, mon):
    with pytest.raises(gradloc.AttachError, match="already has a gradloc monitor"):
        gradloc.watch(model)
    with pytest.raises(gradloc.AttachError, match="already"):
        mon.attach()
    mon.detach()
    with pytest.raises(gradloc.AttachError, match="not attached"):
        mon.detach()
    again = gradloc.watch(model)  # allowed once the first monitor let go
    assert again.attached
    again.close()


# -- a broken probe closure never raises into the training loop -------------------------------------
@pytest.mark.parametrize("probe_result", ["float", "no-grad tensor", "vector", "raises"])
def test_broken_probe_closure_is_reported_not_raised(model, probe_result):
    cfg = gradloc.WatchConfig(update_ratio=False, detector=gradloc.DetectorConfig(abs_threshold=1e-9))
    mon = gradloc.watch(model, config=cfg)
    ids, targets = _batch()
    calls = []

    def probe(i: int, mask: torch.Tensor):
        calls.append(i)
        loss = (_token_ce(model(ids), targets) * mask).sum() / mask.numel()
        if probe_result == "float":
            return float(loss.detach())
        if probe_result == "no-grad tensor":
            return loss.detach()
        if probe_result == "vector":
            return loss.reshape(1).expand(2)
        raise KeyError("user bug in the probe")

    try:
        with mon.micro_batch(targets):
            loss = _token_ce(model(ids), targets).mean()
            loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        values = {n: g.clone() for n, g in grads.items()}
        report = mon.end_step(loss, probe=probe)  # must not raise
        assert calls, "the localizer should have tried the probe"
        assert "abs_threshold" in report.spike.kinds and report.incident is not None
        loc = report.incident.localization
        assert loc.status == "unavailable"
        assert "localization failed" in loc.note
        assert ("ProbeError" in loc.note) if probe_result != "raises" else ("KeyError" in loc.note)
        assert mon.counters["localize_errors"] == 1
        for n, p in model.named_parameters():  # the training gradient is back, untouched
            assert p.grad is grads[n] and torch.equal(p.grad, values[n])
        assert not mon.hooks.suspended
    finally:
        mon.close()


# -- dtypes ---------------------------------------------------------------------------------------------
def test_float64_model_end_step():
    model = _model().double()
    mon = gradloc.watch(model, config=gradloc.WatchConfig(update_ratio=False))
    try:
        ids, targets = _batch()
        with mon.micro_batch(targets):
            _token_ce(model(ids), targets).mean().backward()
        rec = mon.end_step().record
        assert rec.global_norm > 0 and rec.tokens.total_score > 0
    finally:
        mon.close()


# -- an error inside a hook: counted, said once, never reported as if scored ---------------------------------------
def test_a_failing_rule_is_counted_said_once_and_its_gradient_left_unattributed(model, caplog):
    """A rule that raises in backward (every call): training goes on bitwise, the error is counted and said once at
    warning level, and the module's gradient is the step's unattributed share — never reported as scored."""
    import logging

    from gradloc.collector.rules.linear import LinearRule

    calls = []

    def broken(self, module, saved, g):  # noqa: ANN001, ANN202
        calls.append(1)
        raise RuntimeError("the rule broke")

    original = LinearRule.score
    LinearRule.score = broken
    try:
        mon = gradloc.watch(model, store=False)
        with caplog.at_level(logging.WARNING, logger="gradloc"):
            for _ in range(3):
                x, y = _batch()
                with mon.micro_batch(y):
                    _token_ce(model(x), y).mean().backward()
                rec = mon.end_step(None).record
                model.zero_grad()
        mon.close()
    finally:
        LinearRule.score = original
    assert calls and mon.counters["hook_errors"] == len(calls)
    said = [r for r in caplog.records if "per-token hook failed" in r.getMessage()]
    assert len(said) == 1 and "the rule broke" in said[0].getMessage()
    assert rec.tokens.unattributed_share > 0.5  # the linears' gradient: unattributed, not silently zero
