"""FSDP2 (fully_shard) on gloo: norms from shards equal DDP's, every rank probes, training unchanged."""
from __future__ import annotations

import pytest
import torch

from tests.distributed.ddp_job import train
from tests.distributed.launch import run

STEPS, SPIKE = 8, 7
PLANT = (1, SPIKE, 1, 2, 5)


def _job(rank, world, kind, monitor):
    # "full": every layer's ratio every step in both jobs, to compare them step by step (lean's windows tile each
    # rank's own shards under FSDP2 and whole parameters under DDP: the layers complete at different steps)
    out = train(rank, world, kind, STEPS, PLANT, monitor, update_ratio="full")
    reps = out["reports"]
    return {"kind": out["kind"], "collectives": out["collectives"], "params": out["params"],
            "norms": [r.record.global_norm for r in reps], "layers": [{s.layer: s.grad_norm for s in r.record.layers}
                                                                      for r in reps],
            "ratios": out["history_ratios"],
            "loc": reps[SPIKE].incident.localization if reps and reps[SPIKE].incident else None}


@pytest.fixture(scope="module")
def fsdp_and_ddp():
    return run(_job, 2, "fsdp", True, timeout_s=300), run(_job, 2, "ddp", True, timeout_s=300)


def test_per_layer_and_global_norms_from_shards_equal_ddp(fsdp_and_ddp):
    fsdp, ddp = fsdp_and_ddp
    assert fsdp[0]["kind"] == "fsdp"
    for s in range(STEPS):
        assert fsdp[0]["norms"][s] == pytest.approx(ddp[0]["norms"][s], rel=1e-5)
        assert fsdp[0]["norms"][s] == fsdp[1]["norms"][s]  # the job's norm, identical on every rank
        for layer, v in ddp[0]["layers"][s].items():
            assert fsdp[0]["layers"][s][layer] == pytest.approx(v, rel=1e-5), (s, layer)
    assert all(r["collectives"][:SPIKE] == [1] * SPIKE for r in fsdp)  # one gather of O(L) floats a step


def test_update_ratios_are_the_jobs(fsdp_and_ddp):
    """Each rank copies and differences its own shards; the sums travel with the next step's gather,
    so every layer's ratio is the job's: equal to DDP's (full parameters), on every step's record."""
    fsdp, ddp = fsdp_and_ddp
    got, want = fsdp[0]["ratios"], ddp[0]["ratios"]
    assert len(got) == len(want) == STEPS
    assert all(v is not None for r in want for v in r.values())
    # the last step's ratios would need one more gather at close(); close never waits on peers: none
    assert all(v is None for v in got[-1].values())
    for g, w in zip(got[:-1], want[:-1]):
        for layer, v in w.items():
            if v is None:
                assert g[layer] is None
            else:
                assert g[layer] == pytest.approx(v, rel=1e-4), layer


def test_the_culprit_on_rank_1_is_located_with_every_rank_probing(fsdp_and_ddp):
    fsdp, _ = fsdp_and_ddp
    for r in fsdp:
        loc = r["loc"]
        assert loc.status == "located" and loc.probes <= 3, loc.note
        assert [(c.rank, c.micro_batch, c.sample, c.position) for c in loc.culprits] == [(1, 1, 2, 5)]
        assert loc.explained_share > 0.9


def test_training_is_bitwise_identical_with_and_without_gradloc(fsdp_and_ddp):
    fsdp, _ = fsdp_and_ddp
    without = run(_job, 2, "fsdp", False, timeout_s=300)
    for r in range(2):
        for name, p in without[r]["params"].items():
            assert torch.equal(p, fsdp[r]["params"][name]), f"rank {r}: {name} differs"
