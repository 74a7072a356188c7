"""Accelerate on its own with its defaults (tests/defaults/accelerate_job.py):
``Accelerator(gradient_accumulation_steps=2)``, ``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_`` as
its docs write the loop, 4 gloo ranks, the tiny pre-trained HF Llama, a corrupted token on the last rank after 32
healthy steps, the default detector: ``prepare`` wraps the model in DDP (its defaults) and gradloc watches one
DDP job; gradloc's norm is the one ``accelerator.clip_grad_norm_`` returns, on every step and rank; the token is
one job incident located on data rank 3 in ≤ 3 probes, naming it; no collective deadline; the parameters bitwise
those of the same loop without gradloc."""
from __future__ import annotations

import pytest

from tests.defaults.accelerate_job import ENV, MB, POS, ROW, STEPS, UID0, K, planted_row
from tests.distributed.launch import run
from tests.distributed.loop import one_job_incident

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

WORLD = 4
DEADLINE_S = 60.0  # WatchConfig.collective_timeout_s's default


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from tests.defaults.accelerate_job import run_both

    return run(run_both, WORLD, timeout_s=900, env=ENV)


def test_accelerate_runs_ddp_and_gradloc_reports_its_clip_norm(ranks):
    for r in ranks:
        w = r["with"]
        assert (w["distributed_type"], w["processes"], w["wrapped"]) == ("DistributedType.MULTI_CPU", WORLD,
                                                                         "DistributedDataParallel")
        assert w["kind"] == "ddp" and w["errors"] == 0 and not w["counters"] and w["broken"] == "", w
        assert len(w["norms"]) == len(w["clip"]) == STEPS
        assert w["norms"] == pytest.approx(w["clip"], rel=1e-5)  # what accelerator.clip_grad_norm_ returned
    assert all(r["with"]["norms"] == ranks[0]["with"]["norms"] for r in ranks)  # the job's norm on every rank


def test_a_token_on_the_last_rank_is_one_job_incident_without_a_deadline_wait(ranks):
    withs = [r["with"] for r in ranks]
    one_job_incident(withs, K, (WORLD - 1, MB, ROW, str(UID0 + planted_row(WORLD))), POS - 1, text="Z")
    for w in withs:
        assert w["seconds"][K] < DEADLINE_S / 2, w["seconds"][K]  # the spike step, probes included


def test_parameters_bitwise_those_of_the_loop_without_gradloc(ranks):
    import torch

    for rank, r in enumerate(ranks):
        for name, p in r["without"]["params"].items():
            assert torch.equal(p, r["with"]["params"][name]), f"rank {rank}: {name} differs"


def test_without_accelerate_launch_cpu_the_ranks_are_not_one_job():
    """Why ENV: ranks launched torchrun-style on a machine without a GPU are, to ``Accelerator()``, separate
    single processes unless ``ACCELERATE_USE_CPU`` is set (as ``accelerate launch --cpu`` sets it)."""
    from tests.defaults.accelerate_job import plain_type

    assert run(plain_type, 2, timeout_s=300) == ["DistributedType.NO"] * 2
