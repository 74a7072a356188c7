"""The user-facing loop: gradient accumulation, per-layer stats, multi-culprit steps, fallback."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradloc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.helpers` under plain `pytest` too
from tests.helpers import (  # noqa: E402
    backward_step,
    culprit_keys,
    make_data,
    norm_of,
    single_thread,  # noqa: E402,F401 (autouse fixture)
    tiny_gpt,
    train,
)

DET = gradloc.DetectorConfig(warmup=5)


def _counting(probe):
    calls = []

    def wrapped(i, mask):
        calls.append((i, int(mask.sum())))
        return probe(i, mask)

    return wrapped, calls


# -- gradient accumulation ------------------------------------------------------------------------
def test_accumulation_tokens_per_micro_batch_layers_per_step():
    M, steps = 3, 7
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(steps, M)
    planted = data.plant(6, 2, 0, 7)
    mon = gradloc.watch(model, opt, detector=DET)
    for s in range(steps):
        last_mb_norm = None
        total = torch.zeros(())
        for i in range(M):
            before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            with mon.micro_batch(data.y[s, i]):
                loss = data.loss(model, s, i)
                loss.backward()
            total += loss.detach()
            last_mb_norm = norm_of([p.grad - b for p, b in zip(model.parameters(), before)])
        accumulated = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        rep = mon.end_step(total, probe=data.probe(model, s))
        pre_clip = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))  # after end_step
        rec = rep.record
        assert rec.step == s and rec.micro_batches == M
        assert rec.loss == pytest.approx(float(total), rel=1e-6)
        # layer stats: once per optimizer step, over the accumulated gradient, pre-clip
        assert rec.global_norm == pytest.approx(accumulated, rel=1e-5)
        assert rec.global_norm == pytest.approx(pre_clip, rel=1e-5)
        if s < 6:  # (at step 6 the culprit's micro-batch is the last one and dominates)
            assert not math.isclose(rec.global_norm, last_mb_norm, rel_tol=1e-3)
        assert math.sqrt(sum(x.grad_norm**2 for x in rec.layers)) == pytest.approx(accumulated, rel=1e-5)
        # token stats: per micro-batch
        tok = rec.tokens
        assert tok.tokens == M * 4 * 16
        assert len(tok.micro_batch_shares) == M
        assert sum(tok.micro_batch_shares) == pytest.approx(1.0, rel=1e-5)
        assert all(0.0 <= x <= 1.0 for x in tok.micro_batch_shares)
        if s < 6:
            assert rep.incident is None
            assert max(tok.micro_batch_shares) < 0.9  # no micro-batch dominates a healthy step
        opt.step()
        opt.zero_grad()
    tok = rec.tokens
    assert max(range(M), key=lambda i: tok.micro_batch_shares[i]) == 2
    assert tok.micro_batch_shares[2] > 0.9
    assert (tok.top[0].micro_batch, tok.top[0].sample, tok.top[0].position) == planted
    loc = rep.incident.localization
    assert loc.micro_batch_shares == pytest.approx(tok.micro_batch_shares, rel=1e-5)
    assert culprit_keys(loc) == {planted}
    mon.close()
    assert [r.step for r in mon.history] == list(range(steps))  # one record per optimizer step


# -- per-layer statistics ---------------------------------------------------------------------------
def _expected_stats(model: nn.Module, group) -> dict[str, dict[str, float]]:
    grads, params = {}, {}
    for name, p in model.named_parameters():
        grads.setdefault(group(name), []).append(p.grad)
        params.setdefault(group(name), []).append(p.detach())
    return {g: dict(grad_norm=norm_of(grads[g]), grad_max_abs=max(float(t.abs().max()) for t in grads[g]),
                    param_norm=norm_of(params[g]), numel=sum(t.numel() for t in params[g]))
            for g in grads}


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _body_or_io(name: str) -> str:
    return "body" if name.startswith("blocks.") else "io"


def _assert_ratios(record, expected: dict[str, float | None]) -> None:
    got = {x.layer: x.update_ratio for x in record.layers}
    assert list(got) == list(expected)
    for name, e in expected.items():
        if e is None:
            assert got[name] is None, name
        else:
            assert got[name] == pytest.approx(e, rel=1e-4), name


GROUPINGS = {
    # layer_stats.group_name: "module" = the module owning the parameter; N = the first N dotted
    # parts (at most all but the parameter's own name); a callable maps the parameter name;
    # "parameter" = the parameter itself. name: (WatchConfig value, independent expectation)
    "module": ("module", _module_of),
    "first-2-parts": (2, lambda n: ".".join(n.split(".")[:2]) if n.startswith("blocks.") else n.split(".")[0]),
    "callable": (_body_or_io, lambda n: "body" if n.split(".")[0] == "blocks" else "io"),
    "parameter": ("parameter", lambda n: n),
}


@pytest.mark.parametrize("grouping", list(GROUPINGS), ids=list(GROUPINGS))
def test_per_layer_stats_and_update_ratios(grouping):
    cfg_value, group = GROUPINGS[grouping]
    steps = 4
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = make_data(steps, 2)
    # "full": every layer's ratio every step, to check each against its own (lean covers a quarter a step)
    mon = gradloc.watch(model, opt, layer_grouping=cfg_value, detector=DET, update_ratio="full")
    expected_ratio = []
    for s in range(steps):
        total = backward_step(model, data, s, mon)
        expected = _expected_stats(model, group)
        rep = mon.end_step(total, probe=data.probe(model, s))
        got = {x.layer: x for x in rep.record.layers}
        assert list(got) == list(expected)  # same groups, in parameter order
        for name, e in expected.items():
            x = got[name]
            assert x.grad_norm == pytest.approx(e["grad_norm"], rel=1e-5)
            assert x.grad_max_abs == pytest.approx(e["grad_max_abs"], rel=1e-6)
            assert x.param_norm == pytest.approx(e["param_norm"], rel=1e-5)
            assert x.numel == e["numel"]
            assert x.nonfinite == 0
            assert x.update_ratio is None  # arrives with the next step
        for t in rep.record.tokens.top:  # token layers use the same grouping
            assert {ls.layer for ls in t.layers} <= set(got)
        if s >= 1:  # the previous step's record now carries its update ratios
            prev = mon.history[-1]
            assert prev.step == s - 1
            _assert_ratios(prev, expected_ratio[s - 1])
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        delta, base = {}, {}
        for n, p in model.named_parameters():
            delta.setdefault(group(n), []).append(p.detach() - before[n])
            base.setdefault(group(n), []).append(before[n])
        # zero-initialised parameters (LayerNorm biases, per-parameter grouping) have no ratio
        expected_ratio.append({g: norm_of(delta[g]) / norm_of(base[g]) if norm_of(base[g]) > 0 else None
                               for g in delta})
    mon.close()  # emits the last record with its ratio
    assert [r.step for r in mon.history] == list(range(steps))
    for rec, exp in zip(mon.history, expected_ratio):
        _assert_ratios(rec, exp)
        assert all(r is None or r > 0 for r in exp.values())
        assert sum(r is not None for r in exp.values()) >= len(exp) // 2


# -- several culprits in one step ---------------------------------------------------------------------
def test_three_culprits_in_three_micro_batches():
    M, spike = 4, 6
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(spike + 1, M)
    planted = {data.plant(spike, 0, 1, 3), data.plant(spike, 1, 3, 10), data.plant(spike, 3, 0, 15)}
    mon = gradloc.watch(model, opt, detector=DET)
    train(model, opt, data, mon, steps=spike)
    total = backward_step(model, data, spike, mon)
    grads_before = [p.grad.clone() for p in model.parameters()]
    probe, calls = _counting(data.probe(model, spike))
    rep = mon.end_step(total, probe=probe)
    for g, p in zip(grads_before, model.parameters()):
        assert torch.equal(g, p.grad), "end_step / probes changed the training gradient"
    mon.close()
    assert rep.incident is not None and "grad_spike" in rep.spike.kinds
    loc = rep.incident.localization
    assert loc.method == "attribution" and loc.status == "located"
    assert culprit_keys(loc) == planted
    assert loc.probes <= 3 and loc.probes == len(calls)
    assert sorted(i for i, _ in calls) == [0, 1, 3]  # one probe per micro-batch holding a culprit
    assert loc.explained_share >= 0.9
    assert loc.norm_without_culprits < 0.1 * loc.global_norm
    assert sum(c.share for c in loc.culprits) == pytest.approx(loc.explained_share, rel=1e-6)


# -- bisection fallback when most of the gradient has no per-token rule ---------------------------
class _CausalConv(nn.Module):
    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.k, self.conv = k, nn.Conv1d(d, d, k)  # no per-token rule for Conv1d

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        return self.conv(F.pad(x.transpose(1, 2), (self.k - 1, 0))).transpose(1, 2)


class _Head(nn.Module):  # owns its parameter directly: no rule either
    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()  # (B, T, D) -> (B, T, V)


class _ConvLM(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)  # the only module with a rule
        self.mix = _CausalConv(d, 4)
        self.head = _Head(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.mix(self.tok(idx))))


def test_bisection_fallback_when_gradient_is_unattributed():
    M, spike = 3, 6
    torch.manual_seed(0)
    model = _ConvLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(spike + 1, M)
    planted = data.plant(spike, 2, 1, 11)
    mon = gradloc.watch(model, opt, detector=DET)
    reports = train(model, opt, data, mon, steps=spike)
    for r in reports:
        assert r.record.tokens.unattributed_share > 0.5
        assert r.incident is None
    total = backward_step(model, data, spike, mon)
    grads_before = [p.grad.clone() for p in model.parameters()]
    probe, calls = _counting(data.probe(model, spike))
    rep = mon.end_step(total, probe=probe)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads_before, model.parameters()))
    mon.close()
    assert rep.record.tokens.unattributed_share > 0.5
    loc = rep.incident.localization
    assert loc.unattributed_share == pytest.approx(rep.record.tokens.unattributed_share)
    assert loc.method == "bisection" and loc.status == "located", loc.note
    assert culprit_keys(loc) == {planted}
    assert loc.explained_share >= 0.9
    assert loc.probes == len(calls)
    # one scan probe per micro-batch, then both halves at each of log2(4·16) levels of the hot one
    assert loc.probes == M + 2 * 6
    assert sorted({i for i, _ in calls}) == [0, 1, 2]
    assert [n for i, n in calls if i == 2][-2:] == [1, 1]


def test_a_micro_batch_block_that_raises_is_left_out_of_the_step():
    """An exception inside a block (e.g. an OOM the user retries) propagates unchanged; the failed
    micro-batch is not part of the step's token stats and is counted."""
    import gradloc
    from gradloc.demo.model import GPTConfig, TinyGPT, token_losses

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=32, seq=8, d_model=16, n_layers=1))
    mon = gradloc.watch(model)
    x, y = torch.randint(0, 32, (2, 2, 8)), torch.randint(0, 32, (2, 2, 8))
    with pytest.raises(RuntimeError, match="simulated OOM"):
        with mon.micro_batch(y[0]):
            model(x[0])
            raise RuntimeError("simulated OOM")
    with mon.micro_batch(y[1]):
        token_losses(model(x[1]), y[1]).mean().backward()
    report = mon.end_step()
    assert report.record.micro_batches == 1
    assert len(report.record.tokens.micro_batch_shares) == 1
    assert mon.counters["failed_micro_batches"] == 1
    mon.close()


# -- the detector's band on the emitted records -----------------------------------------------------
def test_emitted_records_carry_the_band_each_step_was_judged_against():
    """What the overview dashboard draws: the healthy mean and grad_spike line of the step's own
    verdict (during the warm-up, its recent median and the warmup_spike line, from its 3rd step),
    on the record the sinks receive."""
    steps = 10
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = make_data(steps, 2)
    mon = gradloc.watch(model, opt, detector=DET)
    verdicts = []
    for s in range(steps):
        total = backward_step(model, data, s, mon)
        verdicts.append(mon.end_step(total, probe=data.probe(model, s)).spike)
        opt.step()
        opt.zero_grad()
    mon.close()
    assert [r.step for r in mon.history] == list(range(steps))
    for rec, spike in zip(mon.history, verdicts):
        if spike.mean is None and rec.step < 3:  # the warm-up median needs 3 earlier steps
            assert rec.norm_mean is None and rec.norm_threshold is None
        elif spike.mean is None:  # the warm-up's band (issue 32: its spikes are reported against it)
            assert rec.norm_mean > 0 and rec.norm_threshold == pytest.approx(DET.warmup_ratio * rec.norm_mean)
        else:
            assert rec.norm_mean == spike.mean
            det = DET.resolved()  # the grad_spike line: z above the band and the norm spike_ratio × its mean
            line = max(spike.mean + det.z_threshold * spike.std, det.spike_ratio * spike.mean)
            assert rec.norm_threshold == pytest.approx(line, rel=1e-12)
            assert rec.norm_threshold >= rec.norm_mean > 0
    assert sum(r.norm_mean is not None for r in mon.history) >= steps - DET.warmup - 1
