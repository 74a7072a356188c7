"""Per-token scores under activation checkpointing equal the scores without it.

Checkpointing re-runs the blocks' forward (and so gradloc's forward hooks) inside backward. In the
non-reentrant mode the re-run's outputs get no gradient (the original forward's do); in the
reentrant mode the original forward ran under no_grad and only the re-run's outputs get one. Either
way each module's score must be counted once, and the position-exact layer (the last watched module
of the forward, the LM head) must not be replaced by a re-run block.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from gradloc.collector.layer_stats import module_layer_map
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.collector.token_hooks import TokenHooks
from gradloc.demo.model import token_losses
from tests.helpers import single_thread, tiny_gpt  # noqa: F401 (autouse fixture)

B, T, V = 3, 16, 128


def _scores(mode: bool | None, *, twice: bool = False) -> tuple[list[MicroBatchScores], list[str], torch.Tensor]:
    """Two micro-batches through a 2-block TinyGPT; ``mode`` is ``use_reentrant`` (None: no checkpoint).
    ``twice`` runs each block twice per forward (one module called twice inside one checkpoint)."""
    model = tiny_gpt(seed=3)
    for block in model.blocks:
        body = (lambda b: lambda x: b(b(x)))(type(block).forward.__get__(block)) if twice else block.forward
        if mode is not None:
            body = functools.partial(checkpoint, body, use_reentrant=mode)
        block.forward = body
    hooks = TokenHooks(model, module_layer_map(model, "module"))
    hooks.attach()
    gen = torch.Generator().manual_seed(5)
    bufs = []
    for i in range(2):
        x = torch.randint(V, (B, T), generator=gen)
        hooks.begin(i, B, T)
        token_losses(model(x), x.roll(-1, 1)).mean().backward()
        bufs.append(hooks.end())
    hooks.detach()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return bufs, hooks.layers, grads


@pytest.mark.parametrize("twice", [False, True], ids=["once", "module-called-twice"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_scores_match_plain(reentrant: bool, twice: bool):
    ref, layers, ref_grads = _scores(None, twice=twice)
    got, layers_ck, grads = _scores(reentrant, twice=twice)
    assert layers_ck == layers
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)  # the checkpointed model is the same model
    for r, g in zip(ref, got):
        assert r.scores is not None and g.scores is not None
        assert (r.scores > 0).any(dim=(1, 2)).all()  # every layer scored in the plain run
        torch.testing.assert_close(g.scores, r.scores, rtol=1e-4, atol=1e-12)
        assert layers[g.last_layer] == layers[r.last_layer] == "head"
        assert g.matched_calls == r.matched_calls
        assert g.dropped_calls == r.dropped_calls == 0 and g.hook_errors == 0


def test_recompute_counters_per_mode():
    """What each mode does, as the counters see it: non-reentrant captures in forward and skips the
    re-run; reentrant captures only the re-run (its forward ran under no_grad)."""
    (plain, _), _, _ = _scores(None)
    (nonre, _), _, _ = _scores(False)
    (re, _), _, _ = _scores(True)
    assert plain.recompute_calls == {}
    assert nonre.forward_calls == plain.forward_calls
    assert set(nonre.recompute_calls) and set(nonre.recompute_calls) <= set(plain.forward_calls)
    assert all(n <= nonre.forward_calls[k] for k, n in nonre.recompute_calls.items())
    block_modules = {k for k in plain.forward_calls if k.startswith("blocks.")}
    assert set(re.recompute_calls) == block_modules
    assert block_modules.isdisjoint(re.forward_calls)
