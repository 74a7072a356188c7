"""Megatron-core's own ``GPTModel`` (local layer spec) on 2 gloo tensor-parallel ranks, watched by gradloc at its
defaults: the precursor statistics equal what the model computed, read by the test's own hooks in Megatron's
sequence-first layout (tests/distributed/megatron_gpt_job.py) — the residual stream at the final norm (its input is
``[s, b, h]``: read batch-first, its largest RMS named by (micro-batch, row, position), not (…, position, row)),
the output layer's vocabulary-split logits, each attention's largest logit and its lowest head's mean row entropy,
its heads split over the two ranks; its per-token scores cover every parameter (the vocabulary-parallel embedding,
the norms called sequence-first), and a token planted with 3000× its loss is located in ≤ 3 probes."""
from __future__ import annotations

import importlib.util

import pytest

from tests.distributed.launch import run
from tests.distributed.megatron_gpt_job import LAYERS

STEPS, PLANT = 7, (6, 1, 2, 5)  # the last step: (step, micro-batch, sample, position)
ENV = {"NO_VCS_VERSION": "1"}  # megatron's package_info would otherwise run `git rev-parse` at import
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="needs megatron-core (scripts/setup.sh)")


def _train(rank: int, world: int) -> dict:
    from tests.distributed.megatron_gpt_job import train

    return train(rank, world, 2, STEPS, PLANT)


def _stat(got: list, kind: str, layer_part: str) -> tuple:
    hits = [g for g in got if g[0] == kind and layer_part in g[1] and g[2] is None]
    assert len(hits) == 1, (kind, layer_part, got)
    return hits[0]


def test_a_real_gpt_model_s_precursors_under_tensor_parallelism_are_what_it_computed():
    results = run(_train, 2, timeout_s=300, env=ENV)
    for r in results:
        assert not r["counters"], r["counters"]
    for s in range(1, PLANT[0]):  # step 0: each rank's own values (the ranks agree on their layout after it)
        wants = [r["steps"][s]["want"] for r in results]
        for r in results:
            got = r["steps"][s]["got"]
            want = wants[0]
            kind, layer, _, value, at = _stat(got, "residual_rms", "final_layernorm")
            assert layer == "decoder.final_layernorm"
            assert value == pytest.approx(want["residual_rms"][0], rel=1e-5)
            assert at == want["residual_rms"][1], (s, at, want["residual_rms"])  # (micro-batch, row, position)
            _, layer, _, value, at = _stat(got, "logit_max_abs", "output_layer")
            assert value == pytest.approx(want["logit_max_abs"][0], rel=1e-5) and at == want["logit_max_abs"][1]
            for i in range(LAYERS):  # the two ranks' heads together: the largest logit, the lowest head's entropy
                site = f"decoder.layers.{i}.self_attention.core_attention.scale_mask_softmax"
                _, _, _, value, _ = _stat(got, "attn_max_logit", f"layers.{i}.")
                assert value == pytest.approx(max(w[site]["max"] for w in wants), rel=1e-5)
                _, layer, _, value, _ = _stat(got, "attn_entropy", f"layers.{i}.")
                lowest = min(e for w in wants for e in w[site]["entropy"])
                assert layer == site and value == pytest.approx(lowest, rel=1e-6)
    assert results[0]["steps"][1:] and results[0]["steps"][1]["got"] == results[1]["steps"][1]["got"]
    compared = 0
    for s in range(PLANT[0]):  # per-token scores: every parameter has a rule (the vocabulary-parallel embedding, the
        for r in results:  # norms Megatron calls on [s, b, h]): nothing unattributed, no call dropped
            step = r["steps"][s]
            assert step["unattributed"] == pytest.approx(0.0, abs=1e-9) and step["dropped"] == 0, step
            for mb, b, p, score, emb in step["top"]:  # the tp ranks' rows together: the whole table's ‖g_p‖²
                if emb > 0:  # (a token lists its five largest layer parts)
                    assert emb == pytest.approx(step["want"]["embedding"][mb][b][p], rel=1e-4), (s, mb, b, p)
                    assert emb < score
                    compared += 1
    assert compared >= PLANT[0], compared
    for r in results:  # the planted token: one incident, located on its rank (tp rank 0: the tp group is one data
        # index) in at most 3 probes
        assert all(step["loc"] is None for step in r["steps"][:PLANT[0]])
        status, probes, culprits = r["steps"][PLANT[0]]["loc"]
        assert status == "located" and 1 <= probes <= 3 and culprits[0] == (0, *PLANT[1:]), (status, probes, culprits)


def _train_qk(rank: int, world: int) -> dict:
    from tests.distributed.megatron_gpt_job import train

    return train(rank, world, 1, STEPS, PLANT, qk_layernorm=True)


def test_megatron_s_q_k_layernorm_is_scored_per_position_without_tensor_parallelism():
    """Megatron's q/k layernorm (``qk_layernorm=True``: torch norms each attention calls on ``[s, b, heads, d]``),
    one process, tp = 1: every call is placed at its (b, s) — the heads share the norm, so a position's gradient is
    summed over them (rules/megatron.SequenceFirstNorm, its brute-force test in tests/collector/rules) — nothing is
    unattributed or dropped, and the planted token is located. Under tp > 1 each rank holds only its heads' part of
    a position's gradient: such calls are dropped and counted (the same brute-force test)."""
    (r,) = run(_train_qk, 1, timeout_s=300, env=ENV)
    assert not r["counters"], r["counters"]
    for s, step in enumerate(r["steps"][:PLANT[0]]):
        assert step["unattributed"] == pytest.approx(0.0, abs=1e-9) and step["dropped"] == 0, (s, step)
        assert step["loc"] is None
    status, probes, culprits = r["steps"][PLANT[0]]["loc"]
    assert status == "located" and 1 <= probes <= 3 and culprits[0][1:] == PLANT[1:], (status, probes, culprits)
