"""The peer variants are set up to compute what the docs say they compute.

Opacus (ghost norms) and BackPACK (``BatchL2Grad``) are configured to compute the same quantity,
each sequence's contribution to the step's gradient, by different algorithms: their per-parameter
per-sample norms must agree. Real libraries, tiny model, one thread.
"""
from __future__ import annotations

import copy

import pytest
import torch

from bench.peers import BackpackL2, ContiguousTinyGPT, OpacusGhost
from gradloc.demo.model import token_losses
from tests.helpers import VOCAB, single_thread, tiny_gpt  # noqa: F401 (autouse fixture)

pytest.importorskip("opacus")
pytest.importorskip("backpack")


def _batch(seed: int = 1, B: int = 3, T: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]  # (B, T+1) -> 2 × (B, T), not contiguous


def test_contiguous_tinygpt_computes_the_same_logits_and_gradients():
    base = tiny_gpt()
    twin = ContiguousTinyGPT(base.cfg)
    twin.load_state_dict(base.state_dict())
    x, y = _batch()
    for m in (base, twin):
        token_losses(m(x), y).sum().backward()
    assert torch.equal(base(x), twin(x))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(base.parameters(), twin.parameters()))


def test_opacus_and_backpack_per_sample_norms_agree():
    base = tiny_gpt()
    x, y = _batch()
    n_tokens = x.numel()
    opacus = OpacusGhost("opacus_ghost", copy.deepcopy(base), lr=1e-3)
    backpack = BackpackL2("backpack_l2", copy.deepcopy(base), lr=1e-3)
    for v in (opacus, backpack):
        v.micro_step(x, y, n_tokens)
        v.end_step(torch.zeros(()))
    inner = opacus.model._module
    compared = 0
    for (name, p_op), p_bp in zip(inner.named_parameters(), backpack.model.parameters()):
        if not hasattr(p_bp, "batch_l2"):
            assert ".ln" in name or name.startswith("ln_f."), name  # only LayerNorm lacks an extension
            continue
        torch.testing.assert_close(p_op._norm_sample, p_bp.batch_l2.sqrt(), rtol=1e-4, atol=1e-7)
        compared += 1
    assert compared == 2 + 2 * 8 + 1  # tok, pos; per block 4 Linear × (weight, bias); head
    # the step's read-out: one norm per sequence; BackPACK's leaves LayerNorm out, so it is smaller
    assert len(opacus.last) == len(backpack.last) == x.shape[0]
    assert all(0 < b <= o for o, b in zip(opacus.last, backpack.last))
    assert backpack.extra["params_without_batch_l2"]
