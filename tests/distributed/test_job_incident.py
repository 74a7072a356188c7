"""A DDP job's incident reaches the store once: every rank localizes the job's spike together, rank 0
emits one job-scope incident, and the correlator neither duplicates it nor rescales its shares.

Embedded mode (rank 0's in-process agent, SQLite store) and a real ``gradloc-agent serve`` daemon
that every rank ships to over gRPC."""
from __future__ import annotations

from pathlib import Path

from tests.distributed.ddp_job import train
from tests.distributed.launch import run
from tests.system.agent_proc import running_daemon

STEPS, SPIKE = 8, 7
PLANT = (1, SPIKE, 1, 2, 5)  # rank 1, step 7, micro-batch 1, sample 2, position 5


def _job(rank, world, watch):
    out = train(rank, world, "ddp", STEPS, PLANT, True, job="ddp-it", **watch)
    inc = out["reports"][SPIKE].incident
    return {"located": inc is not None and inc.localization.status == "located"}


def _stored(db: Path) -> list:
    from gradloc.store.sqlite import IncidentStore

    with IncidentStore(db) as store:
        return list(store.iter_incidents(job="ddp-it"))


def _check(incidents: list, ranks_with_shares: bool) -> None:
    assert [i.step for i in incidents] == [SPIKE], [(i.step, i.kinds) for i in incidents]
    (inc,) = incidents
    assert inc.status == "complete" and inc.ranks_missing == ()
    assert len(inc.findings) == 1 and inc.findings[0].scope == "job" and inc.findings[0].rank == 0
    top = inc.spans[0]
    assert (top.rank, top.span.micro_batch, top.span.sample, top.span.start) == (1, 1, 2, 5)
    assert top.span.rank == 1 and top.share == inc.findings[0].localization.spans[0].share  # not rescaled
    assert len({(s.rank, s.span.micro_batch, s.span.sample, s.span.start) for s in inc.spans}) == len(inc.spans)
    shares = {r.rank: r.share for r in inc.rank_shares}
    if ranks_with_shares:
        assert set(shares) == {0, 1} and shares[1] > 0.9 and abs(sum(shares.values()) - 1) < 1e-6
    else:
        assert shares == {0: None} and "did not hear rank(s) 1" in inc.note


def test_embedded_mode_stores_one_job_incident_on_rank_0(tmp_path: Path) -> None:
    db = tmp_path / "job.db"
    res = run(_job, 2, {"store": True, "store_path": str(db)}, timeout_s=300)
    assert all(r["located"] for r in res)
    _check(_stored(db), ranks_with_shares=False)


def test_a_daemon_hearing_every_rank_stores_one_job_incident_with_rank_shares(tmp_path: Path) -> None:
    with running_daemon(tmp_path, "--straggler-deadline-s", "120") as agent:
        res = run(_job, 2, {"agent": agent.ingest}, timeout_s=300)
        assert all(r["located"] for r in res)
    # The daemon exited cleanly (SIGTERM): everything it received is committed.
    _check(_stored(agent.db), ranks_with_shares=True)
