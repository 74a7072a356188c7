"""A job-scope incident (DDP, ZeRO: rank 0 localized the spike across the ranks) waits for every
rank that talks to the daemon, including one that has not sent a single record yet: its client's
hello, sent at construction, told the daemon it exists.

Regression: in a short DDP run every rank sent all its records with its first flush; when rank 0's
batch (records and incident) arrived before rank 1's first batch, the daemon had never heard of
rank 1 and stored the incident at once, without rank 1 and without rank shares (a CI run of
tests/distributed/test_job_incident.py caught it). Here rank 1 flushes only on demand, after rank
0's incident is in. A real daemon process and real clients."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from gradloc.records import TokenStats
from gradloc.transport import AgentClient
from tests.builders import JOB, incident_record, step_record
from tests.system.agent_proc import running_daemon

pytestmark = pytest.mark.integration


def _tokens(total: float) -> TokenStats:
    return TokenStats(tokens=64, total_score=total, top=(), top_share=0.0, micro_batch_shares=(1.0,),
                      unattributed_share=0.0)


def _poll(cond, timeout_s: float = 30.0) -> bool:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_job_incident_waits_for_a_rank_that_has_sent_no_record_yet(tmp_path: Path) -> None:
    with running_daemon(tmp_path, "--straggler-deadline-s", "120") as agent:
        quiet = AgentClient(agent.ingest, job=JOB, rank=1, world_size=2, flush_interval_s=3600.0)
        heard = f'gradloc_client_dropped_total{{job="{JOB}",rank="1"'
        assert _poll(lambda: heard in agent.get("/metrics")[0].decode()), "the hello never reached the daemon"
        loud = AgentClient(agent.ingest, job=JOB, rank=0, world_size=2)
        loud.on_step(step_record(7, rank=0, tokens=_tokens(3.0)))
        loud.on_incident(incident_record(7, rank=0, scope="job"))
        assert loud.force_flush(10)
        assert agent.json("/api/incidents") == []  # open: rank 1 has not reported step 7
        quiet.on_step(step_record(7, rank=1, tokens=_tokens(1.0)))
        assert quiet.force_flush(10)
        assert _poll(lambda: len(agent.json("/api/incidents")) == 1)
        loud.shutdown(5)
        quiet.shutdown(5)
    from gradloc.store.sqlite import IncidentStore

    with IncidentStore(agent.db) as store:
        (inc,) = store.iter_incidents(job=JOB)
    assert inc.status == "complete" and inc.ranks_reported == (0, 1) and inc.ranks_missing == ()
    assert {r.rank: r.share for r in inc.rank_shares} == {0: 0.75, 1: 0.25}
