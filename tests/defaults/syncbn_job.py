"""A DDP job whose model holds a ``SyncBatchNorm``: collectives inside the model's own forward and backward.

``SyncBatchNorm`` all-reduces batch statistics only in training mode, and there only on GPU-class devices:
torch raises for CPU input, and DDP refuses to wrap a CPU module that holds one. So on these CPU machines the
module runs in eval mode and DDP's refusal is switched off for this test (``_passing_sync_batchnorm_handle``,
the one check; a stand-in because the real thing cannot run without a GPU): what runs here is
gradloc's side — the model is recognised at attach, a warning says probes are off, and a spike is reported
with attribution shares (``unverified``) and that reason, never a probe that would wait on the other ranks.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

VOCAB, SEQ, B, M, D = 64, 12, 4, 2, 32
HEALTHY = 12
PLANT = (1, 2, 7)  # (micro-batch, sample, position) on the last rank, at step HEALTHY


class BatchNormLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.mix = nn.Linear(D, D)
        self.norm = nn.SyncBatchNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(ids)))  # (B, T, D)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)  # (B, T, D) -> (B, D, T) -> (B, T, D)
        return self.head(h)  # (B, T, V)


def train(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    import gradloc

    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: logs.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gradloc").addHandler(handler)
    torch.manual_seed(0)
    model = BatchNormLM()
    model.norm.eval()  # see the module docstring: SyncBatchNorm trains only on GPU-class devices
    DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None  # its CPU refusal
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5 + 100 * rank)
    ids = torch.randint(VOCAB, (HEALTHY + 1, M, B, SEQ + 1), generator=g)
    x, y = ids[..., :-1], ids[..., 1:]
    w = torch.ones(HEALTHY + 1, M, B, SEQ)
    if rank == world - 1:
        w[(HEALTHY, *PLANT)] = 3000.0
    mon = gradloc.watch(ddp, opt, store=False, detector=gradloc.DetectorConfig(warmup=5))
    incidents = []
    for s in range(HEALTHY + 1):
        def loss_for(i: int, mask: torch.Tensor | None = None, s: int = s) -> torch.Tensor:
            terms = nn.functional.cross_entropy(ddp(x[s, i]).reshape(-1, VOCAB), y[s, i].reshape(-1),
                                                reduction="none").view(B, SEQ) * w[s, i]  # (B·T,) -> (B, T)
            return (terms if mask is None else terms * mask).sum() / (B * SEQ * M)

        total = torch.zeros(())
        for i in range(M):
            with (ddp.no_sync() if i < M - 1 else contextlib.nullcontext()), mon.micro_batch(y[s, i]):
                loss = loss_for(i)
                loss.backward()
            total += loss.detach()
        rep = mon.end_step(total, probe=loss_for)
        opt.step()
        opt.zero_grad()
        if rep.incident is not None:
            loc = rep.incident.localization
            incidents.append((s, str(loc.status), loc.probes, loc.note,
                              [(c.rank, c.micro_batch, c.sample, c.position) for c in loc.culprits]))
    hazard, broken = mon.job.data.probe_hazard, mon.comm.broken
    mon.close()
    logging.getLogger("gradloc").removeHandler(handler)
    return {"logs": logs, "hazard": hazard, "broken": broken, "incidents": incidents}
