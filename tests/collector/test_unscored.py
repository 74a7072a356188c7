"""A watched module that a step does not score counts as unattributed, whether or not it ran."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradloc
from tests.helpers import single_thread  # noqa: F401


class FusedHead(nn.Module):
    """The head's weight is used without calling the head (as TRL's fused log-prob kernel does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)

    def forward(self, ids: torch.Tensor, fused: bool) -> torch.Tensor:
        h = torch.tanh(self.mid(self.emb(ids)))
        return F.linear(h, self.head.weight) if fused else self.head(h)


@pytest.mark.parametrize("fused", [False, True])
def test_a_module_used_without_being_called_is_unattributed(fused):
    model = FusedHead()
    mon = gradloc.watch(model, store=False, update_ratio="off")
    ids = torch.randint(50, (3, 7), generator=torch.Generator().manual_seed(1))
    with mon.micro_batch(ids):
        loss = F.cross_entropy(model(ids, fused).flatten(0, 1), ids.flatten())
        loss.backward()
    rep = mon.end_step(loss.detach())
    mon.close()
    sq = {n: float(p.grad.double().pow(2).sum()) for n, p in model.named_parameters()}
    head = sq["head.weight"] / sum(sq.values())
    assert head > 0.05
    share = rep.record.tokens.unattributed_share
    assert share == pytest.approx(head if fused else 0.0, rel=1e-5, abs=1e-12)
