"""ProbeSession (training state put back, in-place accumulation, typed errors) and the float64 helpers."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc.collector.batch import make_meta
from gradloc.errors import ProbeError
from gradloc.localizer import probes
from gradloc.localizer.probes import ProbeSession, dot, grad_norm
from tests.helpers import single_thread  # noqa: F401
from tests.localizer.toy import Toy, basis, planted

D = 8


def toy() -> Toy:
    g = torch.Generator().manual_seed(3)
    return Toy(torch.randint(-3, 4, (2, 2, 4, D), generator=g).double())


def session(t: Toy, closure=None, calls: list | None = None) -> ProbeSession:
    suspend = (lambda on: calls.append(on)) if calls is not None else (lambda on: None)
    return ProbeSession(t.model, [t.w], t.metas, closure or t.probe, suspend)


def mask(*positions: tuple[int, int]) -> torch.Tensor:
    m = torch.zeros(2, 4, dtype=torch.bool)
    for b, p in positions:
        m[b, p] = True
    return m


def test_session_gives_back_the_very_gradient_tensors_untouched() -> None:
    t = toy()
    train_grad = t.grad_of().clone()
    t.w.grad = train_grad
    calls: list[bool] = []
    with session(t, calls=calls) as s:
        assert t.w.grad is None  # moved aside: probes cannot accumulate into it
        g = s.grad(0, mask((0, 1), (1, 2)))
        assert torch.equal(g[0], t.grad_of([1, 6]))
        assert t.w.grad is None  # nothing left on the parameter between probes
    assert t.w.grad is train_grad and torch.equal(train_grad, t.grad_of())
    assert calls == [True, False] and s.count == 1
    assert s.losses == [pytest.approx(t.loss_of([1, 6]), rel=1e-12)]


def test_add_to_accumulates_in_place_and_is_additive_over_disjoint_masks() -> None:
    t = toy()
    with session(t) as s:
        acc = s.grad(0, mask((0, 0), (0, 3)))
        first = acc[0]
        acc = s.add_to(acc, 0, mask((1, 1)))
        assert acc[0] is first  # summed in place: one gradient copy however many probes
        union = s.grad(0, mask((0, 0), (0, 3), (1, 1)))
        assert torch.equal(acc[0], union[0])
        acc = s.add_to(acc, 1, mask((1, 3)))
        assert torch.equal(acc[0], t.grad_of([0, 3, 5, 15])) and s.count == 4


def test_buffers_mutated_in_place_by_the_closure_are_restored() -> None:
    t = toy()

    def closure(i: int, m: torch.Tensor) -> torch.Tensor:
        t.model.calls += 1
        return t.probe(i, m)

    buf = t.model.calls
    with session(t, closure) as s:
        s.grad(0, mask((0, 0)))
        s.grad(1, mask((0, 0)))
        assert int(t.model.calls) == 2
    assert t.model.calls is buf and int(buf) == 0


def test_buffers_reassigned_by_the_closure_are_put_back() -> None:
    """Some modules re-register a buffer in forward (transformers' dynamic RoPE: register_buffer("inv_freq", …))."""
    t = toy()

    def closure(i: int, m: torch.Tensor) -> torch.Tensor:
        t.model.register_buffer("calls", t.model.calls + 1)
        return t.probe(i, m)

    buf = t.model.calls
    with session(t, closure) as s:
        s.grad(0, mask((0, 0)))
        assert t.model.calls is not buf
    assert t.model.calls is buf and int(buf) == 0


def rng_toy() -> tuple[Toy, list[torch.Tensor]]:
    """Micro-batch m's block opened at RNG state S_m, and its forward then drew ``draws[m]``."""
    t = toy()
    torch.manual_seed(11)
    metas, draws = [], []
    for m in range(2):
        metas.append(make_meta(m, None, None, None, (2, 4)))
        draws.append(torch.rand(3))
    t.metas = tuple(metas)
    return t, draws


def next_draw() -> torch.Tensor:
    """What the training loop's next torch.rand(4) draws, without drawing it."""
    state = torch.get_rng_state()
    out = torch.rand(4)
    torch.set_rng_state(state)
    return out


def test_each_probe_replays_its_micro_batch_rng_and_the_session_restores_the_rng() -> None:
    t, draws = rng_toy()
    seen: list[torch.Tensor] = []

    def closure(i: int, m: torch.Tensor) -> torch.Tensor:
        seen.append(torch.rand(3))  # the dropout masks a probe draws
        return t.probe(i, m)

    expected = next_draw()
    with session(t, closure) as s:
        s.grad(1, mask((0, 0)))
        s.grad(0, mask((0, 0)))
        s.grad(1, mask((1, 1)))
    assert torch.equal(torch.rand(4), expected)  # the training loop's RNG goes on as if nothing ran
    assert [torch.equal(a, b) for a, b in zip(seen, [draws[1], draws[0], draws[1]])] == [True] * 3


def test_a_raising_closure_still_restores_gradients_buffers_and_rng() -> None:
    t, _ = rng_toy()
    train_grad = t.grad_of().clone()
    t.w.grad = train_grad
    buf = t.model.calls

    def closure(i: int, m: torch.Tensor) -> torch.Tensor:
        t.model.calls += 7
        torch.rand(10)
        raise RuntimeError("CUDA out of memory, say")

    expected = next_draw()
    calls: list[bool] = []
    with pytest.raises(RuntimeError, match="out of memory"):
        with session(t, closure, calls) as s:
            s.grad(0, mask((0, 0)))
    assert t.w.grad is train_grad and torch.equal(train_grad, t.grad_of())
    assert t.model.calls is buf and int(buf) == 0
    assert torch.equal(torch.rand(4), expected)
    assert calls == [True, False] and s.losses == []


@pytest.mark.parametrize("bad", [
    lambda t, i, m: t.probe(i, m).reshape(1).expand(2),  # not a scalar
    lambda t, i, m: t.probe(i, m).detach(),  # no graph
    lambda t, i, m: 1.0,  # not a tensor
])
def test_a_closure_returning_no_scalar_loss_with_grad_raises_probe_error(bad) -> None:
    t = toy()
    t.w.grad = train = t.grad_of().clone()
    with pytest.raises(ProbeError, match="scalar loss tensor that requires grad"):
        with session(t, lambda i, m: bad(t, i, m)) as s:
            s.grad(0, mask((0, 0)))
    assert t.w.grad is train


def test_a_one_element_loss_is_accepted() -> None:
    t = planted({(0, 0, 0): basis(D, 1, 5)}, M=1)
    with session(t, lambda i, m: t.probe(i, m).reshape(1, 1)) as s:
        assert torch.equal(s.grad(0, torch.ones(2, 4, dtype=torch.bool))[0], t.grad_of())


# -- float64 helpers ---------------------------------------------------------------------------------
def tensors() -> tuple[list, list]:
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(5, 10, generator=g), None, torch.randn(37, generator=g).double(),
         torch.randn(3, 3, generator=g).to(torch.bfloat16), torch.randn(4, generator=g)]
    b = [torch.randn(5, 10, generator=g), torch.randn(2, generator=g), None,
         torch.randn(3, 3, generator=g), torch.randn(4, generator=g).double()]
    return a, b


@pytest.mark.parametrize("chunk", [1 << 22, 7, 1])
def test_dot_equals_a_float64_reference_also_when_chunked(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes, "_CHUNK", chunk)  # 50 elements in chunks of 7: a ragged last chunk
    a, b = tensors()
    ref = sum(float((x.double().reshape(-1) * y.double().reshape(-1)).sum())
              for x, y in zip(a, b) if x is not None and y is not None)
    assert dot(a, b) == pytest.approx(ref, rel=1e-12)
    assert dot(a, b, 0.25) == pytest.approx(ref * 0.25, rel=1e-12)
    assert dot([None, a[1]], [b[0], None]) == 0.0


def test_grad_norm_equals_a_float64_reference_to_float32_precision() -> None:
    a, _ = tensors()
    ref = math.sqrt(sum(float((x.double() ** 2).sum()) for x in a if x is not None))
    assert grad_norm(a) == pytest.approx(ref, rel=1e-6)  # foreach_norms returns float32 norms
    assert grad_norm([None, None]) == 0.0 and grad_norm([]) == 0.0
