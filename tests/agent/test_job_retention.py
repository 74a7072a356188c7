"""Jobs that end are forgotten: a (job, rank) silent for ``job_retention_s`` leaves the correlator and
the telemetry state (its series leave /metrics), and so does a job once all its ranks are gone.

The core runs on an injected wall clock, so an hour of silence is one assignment, not a sleep.
"""
from __future__ import annotations

import numpy as np
import pytest

from gradloc.agent.activity import Activity
from gradloc.agent.config import AgentConfig, load_config
from gradloc.agent.core import AgentCore, CoreConfig, Declare, DropReport
from gradloc.agent.correlator import CorrelatorConfig
from gradloc.agent.daemon import Daemon
from gradloc.errors import ConfigError
from gradloc.exporters.prometheus import render
from tests.builders import columns, rank_finding, summary

RETENTION = 3600.0


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def send(core: AgentCore, clock: Clock, job: str, rank: int, n: int, world: int = 2) -> None:
    s = summary(job, rank, n, columns(np.ones(3)), time_unix=clock.t)
    assert core.submit([Declare(job, rank, world), DropReport(job, rank, (("queue_full", 0),)), s], timeout_s=5)


def metrics(core: AgentCore) -> str:
    return render(core.state, None)[0].decode()


def settle(core: AgentCore) -> None:
    """Two empty submissions, then flush: the worker forgets between items (housekeeping), so the
    first one's housekeeping has run by the time the second is processed."""
    assert core.submit([], timeout_s=5) and core.submit([], timeout_s=5) and core.flush(10)


@pytest.fixture()
def core_and_clock():
    clock = Clock()
    core = AgentCore(CoreConfig(job_retention_s=RETENTION,
                                correlator=CorrelatorConfig(straggler_deadline_s=1e6)), clock=clock).start()
    yield core, clock
    core.close(timeout_s=10)


def test_an_ended_job_and_a_departed_rank_are_forgotten(core_and_clock) -> None:
    core, clock = core_and_clock
    for job in ("ended", "running"):
        for rank in (0, 1):
            send(core, clock, job, rank, 1)
    assert core.flush(10)
    assert core.activity.jobs == 2 and core.activity.ranks == 4
    assert 'job="ended"' in metrics(core) and core.correlator.jobs == {"ended", "running"}

    clock.t += RETENTION / 2
    send(core, clock, "running", 0, 2)  # rank 1 of "running" left halfway (elastic), "ended" ended
    clock.t += RETENTION / 2 + 1
    send(core, clock, "running", 0, 3)
    settle(core)
    text = metrics(core)
    assert 'job="ended"' not in text, "the ended job's series are still exported"
    assert 'rank="1"' not in text, "the departed rank's series are still exported"
    assert core.correlator.jobs == {"running"}
    assert core.activity.jobs == 1 and core.activity.ranks == 1
    text = metrics(core)
    assert 'gradloc_steps_total{job="running",rank="0"} 3.0' in text

    clock.t += RETENTION + 1  # then the last rank goes quiet too: the whole job goes
    settle(core)
    assert 'job=' not in metrics(core) and core.correlator.jobs == set()
    assert core.activity.jobs == 0 and core.activity.ranks == 0


def test_a_silent_rank_is_kept_before_the_retention(core_and_clock) -> None:
    core, clock = core_and_clock
    send(core, clock, "j", 0, 1, world=1)
    clock.t += RETENTION - 1
    send(core, clock, "other", 0, 1, world=1)
    settle(core)
    assert 'job="j"' in metrics(core) and core.correlator.jobs == {"j", "other"} and core.activity.jobs == 2


def test_a_job_with_an_open_incident_is_kept_until_it_closes(core_and_clock) -> None:
    core, clock = core_and_clock
    send(core, clock, "j", 0, 4)
    assert core.submit([rank_finding("j", 0, 4)], timeout_s=5)  # rank 1 never reports: the incident stays open
    assert core.flush(10) and core.correlator.pending == 1
    clock.t += 2 * RETENTION
    send(core, clock, "other", 0, 1, world=1)
    settle(core)
    assert core.correlator.jobs == {"j", "other"} and 'job="j"' in metrics(core)
    assert core.activity.jobs == 2  # still tracked, so it is forgotten once the incident closes


def test_activity_expires_ranks_then_jobs_and_skips_kept_ones() -> None:
    a = Activity()
    a.touch("a", 0, 10.0)
    a.touch("a", 1, 20.0)
    a.touch("b", 0, 5.0)
    a.touch("b", 0, 30.0)  # the latest item counts
    assert (a.jobs, a.ranks) == (2, 3)
    assert a.expire(15.0) == ([("a", 0)], [])
    assert a.expire(35.0, keep={"b"}) == ([], ["a"])
    assert (a.jobs, a.ranks) == (1, 1)
    assert a.expire(35.0) == ([], ["b"]) and (a.jobs, a.ranks) == (0, 0)


def test_job_retention_is_one_setting_everywhere(tmp_path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text("job_retention_s = 60\n")
    assert load_config(str(f), {}).job_retention_s == 60.0
    assert load_config(None, {"GRADLOC_AGENT_JOB_RETENTION_S": "90"}).job_retention_s == 90.0
    assert load_config(None, {}, {"job_retention_s": "120"}).job_retention_s == 120.0
    assert AgentConfig().job_retention_s == RETENTION
    with pytest.raises(ConfigError, match="job_retention_s must be > 0"):
        load_config(None, {"GRADLOC_AGENT_JOB_RETENTION_S": "0"})
    with pytest.raises(ConfigError, match="job_retention_s"):
        CoreConfig(job_retention_s=-1)
    assert Daemon(AgentConfig(db="none", job_retention_s=45)).core.config.job_retention_s == 45.0


def test_serve_has_the_flag() -> None:
    from click.testing import CliRunner

    from gradloc.agent.cli import main

    res = CliRunner().invoke(main, ["serve", "--help"])
    assert res.exit_code == 0 and "--job-retention-s" in res.output
    res = CliRunner().invoke(main, ["serve", "--db", "none", "--job-retention-s", "-5"])
    assert res.exit_code == 2 and "job_retention_s must be > 0" in res.output
