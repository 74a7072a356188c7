"""DeepSpeed from a stock JSON config (tests/defaults/ds_job.py) around a Hugging Face Llama, ZeRO-2 and ZeRO-3,
2 gloo ranks, the default detector, a token planted on rank 1 after 32 healthy steps: gradloc's norm is
DeepSpeed's own pre-clip norm, the token is one job incident located on rank 1 in ≤ 3 probes, nothing before it,
training bitwise as without gradloc."""
from __future__ import annotations

import pytest

from tests.defaults.ds_job import HEALTHY, STEPS
from tests.distributed.ds_common import ENV, HAS_DEEPSPEED
from tests.distributed.launch import run

pytestmark = pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed extra (scripts/setup.sh installs it)")
pytest.importorskip("transformers")

WORLD, STAGES = 2, (2, 3)


@pytest.fixture(scope="module")
def ranks(ds_shm_op) -> list[dict]:
    from tests.defaults.ds_job import run_all

    return run(run_all, WORLD, STAGES, timeout_s=900, env=ENV)


@pytest.mark.parametrize("stage", STAGES)
def test_stock_config_norms_location_and_numerics(ranks, stage):
    for r in ranks:
        got = r[stage]
        assert got["kind"] == "deepspeed" and len(got["steps"]) == STEPS
        for s, st in enumerate(got["steps"]):
            assert st["norm"] == pytest.approx(got["ds_norms"][s], rel=1e-5), s
        assert [s for s, st in enumerate(got["steps"]) if st["incident"]] == [HEALTHY]
        loc = got["steps"][HEALTHY]["loc"]
        assert loc["status"] == "located" and 1 <= loc["probes"] <= 3, loc["note"]
        assert loc["culprits"][0] == (WORLD - 1, 1, 2, 5) and {c[0] for c in loc["culprits"]} == {WORLD - 1}
        assert loc["explained"] > 0.9
        assert got["same_params"]
    assert len({repr(r[stage]["steps"][HEALTHY]["loc"]) for r in ranks}) == 1
