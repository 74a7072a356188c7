"""gradloc on verl 0.9.1's own FSDP2 engine (``FSDPEngineWithLMHead``), 2 gloo CPU processes, probes on every rank.

The engine, its configs, ``DataProto``, ``left_right_2_no_padding``, ``compute_grpo_outcome_advantage``,
``compute_rollout_correction_weights`` and the actor loss (``workers/utils/losses.ppo_loss``: ``core_algos``'
vanilla policy loss × ``rollout_is_weights``, ``agg_loss``) are verl's; the only addition is a CPU platform
registered in verl's platform registry (verl_cpu.py). gradloc attaches with
``gradloc.integrations.verl.install(FSDPEngineWithLMHead)``, as a user's ``external_lib`` does
(tests/verl_tier/inside/verl_job.py). An IS weight of e^8 planted on rank 1 at step 7 is one job incident on
both ranks, located with lockstep probes, its share measured against the FSDP2-sharded gradient.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run
from tests.verl_tier.inside.verl_job import PLANT_SAMPLE, PLANT_TOKEN

STEPS, SPIKE = 8, 7


def _rank_main(rank: int, world: int, model_dir: str) -> dict:
    from tests.verl_tier.inside.verl_job import train

    watched = train(rank, world, model_dir, STEPS, (1, SPIKE), True, entropy=True)
    plain = train(rank, world, model_dir, STEPS, (1, SPIKE), False, entropy=True)
    watched["same_params"] = all(torch.equal(p, watched["params"][n]) for n, p in plain["params"].items())
    watched["plain_norms"] = plain["grad_norms"]
    del watched["params"]
    return watched


@pytest.fixture(scope="module")
def ranks(model_dir: str) -> list[dict]:
    return run(_rank_main, 2, model_dir, timeout_s=420)


def test_the_engine_is_an_fsdp2_job_with_probes_on_every_rank(ranks):
    for r in ranks:
        assert r["watched"] and r["kind"] == "fsdp" and r["probes"] is True
        assert r["errors"] == 0 and not r["counters"], r["counters"]
        assert len(r["reports"]) == STEPS
        # gradloc's norm is verl's actor/grad_norm (FSDPEngine.optimizer_step's pre-clip norm), on every rank
        assert [rep[0] for rep in r["reports"]] == pytest.approx(r["grad_norms"], rel=1e-5)
    assert ranks[0]["grad_norms"] == ranks[1]["grad_norms"]


def test_an_is_weight_planted_on_rank_1_is_one_job_incident_located_in_lockstep(ranks):
    locs = []
    for r in ranks:
        assert all(rep[3] is None for rep in r["reports"][:SPIKE])  # no false alarm before the spike
        _, kinds, scope, loc = r["reports"][SPIKE]
        assert "grad_spike" in kinds and scope == "job"
        assert loc.status == "located" and 1 <= loc.probes <= 3, loc.note
        top = loc.culprits[0]
        assert top.rank == 1 and (top.micro_batch, top.sample) == divmod(PLANT_SAMPLE, 4)
        assert top.sample_id == "p2#1" and top.sample_info.request_id == "p2"  # uid p2, its second sample
        assert top.position - top.sample_info.response_start == PLANT_TOKEN
        assert top.classification.kind == "train_inference_mismatch"
        assert top.rl.log_ratio == pytest.approx(8.0, abs=0.1)
        # the probe gradients reduce-scattered over the ranks, against the job's sharded gradient
        assert 0.9 < loc.explained_share < 1.1, loc.explained_share
        locs.append(loc)
    assert repr(locs[0]) == repr(locs[1])


def test_the_policy_entropy_is_verls_on_each_rank_and_the_job_s_over_both(ranks):
    """The engine's token entropies (``calculate_entropy``) reach gradloc from the model output: each rank's record
    has its own mean over its response tokens and the job's over both ranks' (what the drift detector judges), as
    the test reads them from the model output the loss gets."""
    for s in range(SPIKE):  # (the spike step's probes call the loss again)
        sums = [r["entropy_sums"][s] for r in ranks]
        job = sum(e for e, _ in sums) / sum(n for _, n in sums)
        for r, (total, n) in zip(ranks, sums):
            own, job_got = r["entropy"][s]
            assert n > 0 and own == pytest.approx(total / n, rel=1e-9) and job_got == pytest.approx(job, rel=1e-9)
            assert own != pytest.approx(job, rel=1e-8)  # the ranks' own differ from the job's (a random policy's
            # entropies are near log 96 everywhere: ~1e-6 apart)


def test_training_is_bitwise_identical_with_and_without_gradloc(ranks):
    for r in ranks:
        assert r["same_params"]
        assert r["plain_norms"] == r["grad_norms"]


def test_the_probe_is_verls_ppo_loss_restricted_to_the_mask(model_dir):
    """verl's ppo_loss with the IS weights, the entropy bonus and the low_var_kl KL loss on, in the real
    engine's forward_step: the full mask is the training loss (value and gradient), and the losses and
    gradients of a random token subset and of its complement add up to it."""
    (got,) = run(_exactness, 1, model_dir, timeout_s=300)
    train_loss, train_grad = got["train"]
    full_loss, full_grad = got["full"]
    assert full_loss == pytest.approx(train_loss, rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(full_grad, train_grad))
    (some_loss, some_grad), (rest_loss, rest_grad) = got["some"], got["rest"]
    assert abs(some_loss) > 1e-4 and abs(rest_loss) > 1e-4  # neither part is empty
    assert some_loss + rest_loss == pytest.approx(train_loss, rel=1e-5)
    assert all(torch.allclose(a + b, t, atol=1e-6) for a, b, t in zip(some_grad, rest_grad, train_grad))


def _exactness(rank: int, world: int, model_dir: str) -> dict:
    from tests.verl_tier.inside.verl_job import probe_exactness

    return probe_exactness(rank, world, model_dir)

