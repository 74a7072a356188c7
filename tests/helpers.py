"""Tiny shared training harness for the adapter tests (TinyGPT, random tokens, planted culprits).

A step is M micro-batches; micro-batch i's loss is ``Σ_p w_p·mask_p·ce_p / (B·T·M)`` where ``w`` holds
the per-token loss weights (1 everywhere except planted culprits) — the probe closure returns exactly
this with the given token mask, so probes use the same scaling as training.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from gradloc.demo.model import GPTConfig, TinyGPT, token_losses

VOCAB, SEQ, D_MODEL = 128, 16, 32


@pytest.fixture(autouse=True)
def single_thread():
    """Import into a test module to run its tests on one intra-op thread: these models are tiny, and
    with 2 OpenMP threads on a busy 2-core machine the spinning barriers made tests ~10× slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_gpt(seed: int = 0, **kw) -> TinyGPT:
    torch.manual_seed(seed)
    cfg = dict(vocab=VOCAB, seq=SEQ, d_model=D_MODEL, n_layers=2, n_heads=4)
    cfg.update(kw)
    return TinyGPT(GPTConfig(**cfg))


@dataclass
class Data:
    x: torch.Tensor  # (steps, M, B, T) inputs
    y: torch.Tensor  # (steps, M, B, T) labels (the ids each loss position scores)
    w: torch.Tensor  # (steps, M, B, T) float per-token loss weights

    @property
    def micro(self) -> int:
        return self.x.shape[1]

    def plant(self, step: int, mb: int, sample: int, pos: int, factor: float = 3000.0) -> tuple[int, int, int]:
        self.w[step, mb, sample, pos] = factor
        return mb, sample, pos

    def loss(self, model: nn.Module, s: int, i: int, mask: torch.Tensor | None = None,
             autocast: bool = False) -> torch.Tensor:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            logits = model(self.x[s, i])  # (B, T, V)
        terms = token_losses(logits, self.y[s, i]) * self.w[s, i]  # (B, T)
        if mask is not None:
            terms = terms * mask
        return terms.sum() / (terms.numel() * self.micro)

    def probe(self, model: nn.Module, s: int, autocast: bool = False):
        return lambda i, mask: self.loss(model, s, i, mask, autocast)


def make_data(steps: int, micro: int, batch: int = 4, seq: int = SEQ, vocab: int = VOCAB, seed: int = 1234) -> Data:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (steps, micro, batch, seq + 1), generator=g)
    return Data(tokens[..., :-1].clone(), tokens[..., 1:].clone(), torch.ones(steps, micro, batch, seq))


def backward_step(model: nn.Module, data: Data, s: int, mon=None, *, autocast: bool = False,
                  scaler=None) -> torch.Tensor:
    """Forward + backward of all micro-batches of step ``s`` (inside ``mon.micro_batch`` blocks)."""
    total = torch.zeros(())
    for i in range(data.micro):
        with mon.micro_batch(data.y[s, i]) if mon is not None else contextlib.nullcontext():
            loss = data.loss(model, s, i, autocast=autocast)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach()
    return total


def train(model: nn.Module, opt: torch.optim.Optimizer, data: Data, mon=None, *, steps: int | None = None,
          clip: float | None = None, autocast: bool = False) -> list:
    """Plain loop (the user-facing one); returns the StepReports (empty without a monitor)."""
    reports = []
    for s in range(steps if steps is not None else data.x.shape[0]):
        total = backward_step(model, data, s, mon, autocast=autocast)
        if mon is not None:
            reports.append(mon.end_step(total, probe=data.probe(model, s, autocast)))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return reports


def module_grads(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Module name -> gradients of its direct parameters (the 'module' layer grouping)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out.setdefault(name.rsplit(".", 1)[0], []).append(p.grad)
    return out


def norm_of(tensors: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


def culprit_keys(loc) -> set[tuple[int, int, int]]:
    return {(c.micro_batch, c.sample, c.position) for c in loc.culprits}


def train_random_lm(model: nn.Module, vocab: int, steps: int = 3, plant: tuple | None = None, probes: bool = False,
                    logits=lambda out: out):  # noqa: ANN001
    """A few AdamW steps of 2 micro-batches (4 × 16 random tokens) under a default monitor: (reports, covered
    modules). ``plant`` = (step, micro-batch, sample, position): that token's loss weight × 3000; ``logits``:
    the tensor of the model's output (an HF model's ``.logits``)."""
    import gradloc

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mon = gradloc.watch(model, opt, store=False, detector=gradloc.DetectorConfig(warmup=max(2, steps - 2)))
    g = torch.Generator().manual_seed(1)
    reports = []
    for s in range(steps):
        x = torch.randint(vocab, (2, 4, 17), generator=g)
        w = torch.ones(2, 4, 16)
        if plant is not None and s == plant[0]:
            w[plant[1:]] = 3000.0

        def loss(i, mask=None, x=x, w=w):  # noqa: ANN001, ANN202
            terms = token_losses(logits(model(x[i, :, :-1])), x[i, :, 1:]) * w[i]
            return (terms if mask is None else terms * mask).sum() / (terms.numel() * 2)

        total = torch.zeros(())
        for i in range(2):
            with mon.micro_batch(x[i, :, 1:]):
                li = loss(i)
                li.backward()
            total += li.detach()
        reports.append(mon.end_step(total, probe=loss if probes else None))
        opt.step()
        opt.zero_grad()
    covered = mon.hooks.covered_modules
    mon.close()
    return reports, covered


def http_get(url: str) -> tuple[int, str]:
    """GET ``url``: (status, body text)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.read().decode()


@contextlib.contextmanager
def served_core(kind: str, db: str, items: list):
    """An AgentCore (with an SQLite store at ``db`` when ``kind`` is "store", none for "memory") and its HTTP
    server, ``items`` submitted and flushed: (base url, core)."""
    from gradloc.agent.core import AgentCore
    from gradloc.agent.http import AgentHttpServer
    from gradloc.store.sqlite import IncidentStore

    core = AgentCore(store=IncidentStore(db) if kind == "store" else None).start()
    http = AgentHttpServer(core, "127.0.0.1:0").start()
    try:
        core.submit(items)
        assert core.flush(10)
        yield "http://%s:%d" % http.address, core
    finally:
        http.stop()
        core.close()
