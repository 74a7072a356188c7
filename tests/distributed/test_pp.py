"""Pipeline parallelism (torch.distributed.pipelining, 2 stages): torchtitan's own Llama 3 split by its own
``pipeline_llm`` under GPipe and 1F1B, alone (2 processes) and with FSDP2 over the data dim (4), and the demo's
model cut by hand under FSDP2 (4). Every stage reports the job's layers (both stages'); the global norm is a
placement-aware reduction's (torchtitan's own clip norm for its model); nothing is unattributed; a culprit
planted in a micro-batch (its loss on the last stage) is localized with ≤ 3 probes run through the stages and
named with its data rank, in one incident; training is bitwise the same with and without gradloc."""
from __future__ import annotations

import pytest

from tests import titan
from tests.distributed.launch import run

STEPS, AT = 7, 6


def _job(rank: int, world: int, model: str, schedule: str, plant: tuple) -> dict:
    from tests.distributed.pp_job import train_both

    return train_both(rank, world, model, schedule, STEPS, plant)


CASES = [("titan", "GPipe", 2), ("titan", "1F1B", 2), ("titan", "1F1B", 4), ("toy", "GPipe", 4)]


@pytest.mark.parametrize("model,schedule,world", CASES, ids=[f"{m}-{s}-{w}" for m, s, w in CASES])
def test_pipeline_parallel(model, schedule, world):
    if model == "titan" and not titan.HAS_TITAN:
        pytest.skip("needs torchtitan (the titan extra: scripts/setup.sh)")
    dp = world // 2
    plant = (dp - 1, AT, 2, 7)  # (data rank, step, row of the batch, position): micro-batch 2 (one row each)
    results = run(_job, world, model, schedule, plant, timeout_s=600)
    from tests.distributed.pp_job import reference_top

    ref = reference_top(model, world, STEPS)  # data rank 0's first step, the model unsplit in one process
    for r in results[::dp]:  # data rank 0's ranks, one per stage (pp-major): its first step's chunks as micro-batches
        assert [t[:3] for t in r["reports"][0]["top"]] == [t[:3] for t in ref]
        for got, want in zip(r["reports"][0]["top"], ref):
            assert got[3] == pytest.approx(want[3], rel=1e-4)
    names = set(results[0]["reports"][0]["layers"])
    by_stage = {r["stage"]: r["own_layers"] for r in results}
    assert sorted(by_stage) == [0, 1] and len(names) == sum(by_stage.values())  # both stages' layers, once each
    for r in results:
        assert r["bitwise"], "parameters differ with gradloc attached"
        first = r["reports"][0]
        assert set(first["layers"]) == names  # every stage reports the job's layers, both stages'
        assert first["norm"] == pytest.approx(r["ref_norm"], rel=1e-5)  # torchtitan's clip norm; the toy's shards
        assert first["unattributed"] == pytest.approx(0.0, abs=1e-9)
        loc = r["reports"][AT]["loc"]
        assert loc is not None and loc["status"] == "located" and loc["probes"] <= 3, loc
        assert loc["culprits"][0] == (dp - 1, 2, 0, 7)  # data rank, micro-batch 2, its only row, position 7
    assert len({repr(r["reports"][AT]["loc"]) for r in results}) == 1
    assert all(r["reports"][AT]["incidents"] == 1 for r in results)  # every rank holds the incident …
    assert [r["emitted"] for r in results] == [1] + [0] * (world - 1)  # … and rank 0 alone emits it: one incident
