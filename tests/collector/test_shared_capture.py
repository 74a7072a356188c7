"""Modules called one after another on the same input share one input-only capture (q/k/v on one normed
activation: one ‖x_p‖² instead of three), without changing a score or keeping an activation alive."""
from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import gradloc.collector.rules.linear as linear_rule
from gradloc.collector.rules import rule_for
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.collector.token_hooks import TokenHooks

B, T, D = 2, 5, 8


class QKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.RMSNorm(D)
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        y = self.wq(h) * self.wk(h) + self.wv(h)
        return self.out(torch.tanh(y))


def test_qkv_share_one_capture_and_score_as_brute_force(monkeypatch):
    calls = []
    real = linear_rule.sq_norm_last
    monkeypatch.setattr(linear_rule, "sq_norm_last", lambda t, n=1: calls.append(t) or real(t, n))
    model = QKV()
    hooks = TokenHooks(model, {})  # one token layer per module
    hooks.attach()
    x = torch.randn(B, T, D)
    outs = {}
    for name in ("wq", "wk", "wv", "out"):
        getattr(model, name).register_forward_hook(lambda m, a, o, name=name: outs.__setitem__(name, (a[0], o)))
    hooks.begin(0, B, T)
    y = model(x)
    for _, o in outs.values():
        o.retain_grad()
    (y * torch.randn_like(y)).sum().backward()
    buf = hooks.end()
    hooks.detach()

    assert len(calls) == 2 + 4  # forward: one ‖h‖² for wq/wk/wv, one ‖tanh(y)‖² for out; backward: four ‖g_p‖²
    for name in ("wq", "wk", "wv", "out"):  # ‖g_p‖²·‖a_p‖² (+ ‖g_p‖² for out's bias), from autograd's own tensors
        a, o = outs[name]
        g_sq = o.grad.double().pow(2).sum(-1)
        want = g_sq * a.detach().double().pow(2).sum(-1) + (g_sq if name == "out" else 0)
        got = buf.scores[hooks.layers.index(name)].double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_capture_is_recomputed_for_another_or_modified_input():
    lin = nn.Linear(D, D)
    rule = rule_for(lin)
    buf = MicroBatchScores(0, B, T, 1)
    x = torch.randn(B, T, D)
    first = buf.capture(rule, lin, x, lin(x))
    assert buf.capture(rule, lin, x, lin(x)) is first  # the same, unmodified input: shared
    same_values = x.clone()
    assert buf.capture(rule, lin, same_values, lin(same_values)) is not first  # another tensor: its own
    x.mul_(2)  # modified in place: its version moved
    again = buf.capture(rule, lin, x, lin(x))
    assert again is not first
    torch.testing.assert_close(again, 4 * first)


def test_capture_of_a_rule_that_reads_more_than_its_input_is_never_shared():
    norm = nn.RMSNorm(D)
    rule = rule_for(norm)
    assert not getattr(rule, "input_only", False)
    buf = MicroBatchScores(0, B, T, 1)
    x = torch.randn(B, T, D)
    assert buf.capture(rule, norm, x, norm(x)) is not buf.capture(rule, norm, x, norm(x))


def test_shared_capture_keeps_no_activation_alive():
    lin = nn.Linear(D, D)
    buf = MicroBatchScores(0, B, T, 1)
    x = torch.randn(B, T, D)
    ref = weakref.ref(x)
    buf.capture(rule_for(lin), lin, x, lin(x))
    del x
    gc.collect()
    assert ref() is None  # only a weak reference stays with the micro-batch


def test_an_inference_mode_input_is_captured_without_sharing():
    lin = nn.Linear(D, D)
    buf = MicroBatchScores(0, B, T, 1)
    with torch.inference_mode():
        x = torch.randn(B, T, D)  # no version counter
    with torch.no_grad():
        got = buf.capture(rule_for(lin), lin, x, lin(x))
    torch.testing.assert_close(got, x.pow(2).sum(-1))
    assert buf.last_capture is None
