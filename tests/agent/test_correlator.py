"""Cross-rank correlation: one incident per (job, step), shares across ranks, stragglers named."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from gradloc.agent.correlator import Correlator, CorrelatorConfig
from gradloc.errors import ConfigError
from gradloc.reports import CorrelatedIncident

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.builders import rank_finding, rank_summary  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(deadline: float = 5.0) -> tuple[Correlator, list[CorrelatedIncident], Clock]:
    out: list[CorrelatedIncident] = []
    clock = Clock()
    ids = iter(f"{i:032x}" for i in range(1, 100))
    c = Correlator(out.append, CorrelatorConfig(straggler_deadline_s=deadline), lambda: next(ids), clock)
    return c, out, clock


def test_all_ranks_report_one_complete_incident_with_global_shares() -> None:
    c, out, _ = make()
    for r in range(3):
        c.declare("j", r, 3)
    c.on_incident(rank_finding("j", 1, 7))
    c.on_incident(rank_finding("j", 2, 7, share=0.5))
    for r, score in ((0, 1.0), (1, 6.0), (2, 3.0)):
        assert not out
        c.on_step(rank_summary("j", r, 7, total_score=score))
    assert len(out) == 1 and c.pending == 0
    inc = out[0]
    assert inc.status == "complete" and inc.ranks_missing == () and inc.ranks_reported == (0, 1, 2)
    assert [(s.rank, s.share, s.flagged) for s in inc.rank_shares] == [(0, 0.1, False), (1, 0.6, True), (2, 0.3, True)]
    # Spans in global units: rank share × rank-local share, largest first.
    assert [(s.rank, round(s.share, 6)) for s in inc.spans] == [(1, 0.48), (2, 0.15)]
    assert math.isclose(sum(m.share for m in inc.micro_batch_shares), 1.0)
    assert inc.trace_id == f"{1:032x}" and inc.kinds == ("grad_spike",) and inc.probes == 2
    assert inc.global_norm == 4.0 and inc.top_layers == ("head",)


def test_a_rank_that_never_reports_is_named_after_the_deadline() -> None:
    c, out, clock = make(deadline=5.0)
    for r in range(4):
        c.declare("j", r, 4)
    c.on_incident(rank_finding("j", 0, 3))
    for r in range(3):
        c.on_step(rank_summary("j", r, 3))
    clock.t += 4.9
    assert c.poll() == 1 and not out
    clock.t += 0.2
    assert c.poll() == 0
    (inc,) = out
    assert inc.status == "partial" and inc.ranks_missing == (3,) and inc.ranks_expected == (0, 1, 2, 3)
    assert "rank(s) 3 never reported" in inc.note


def test_step_records_that_arrived_before_the_finding_are_used() -> None:
    c, out, _ = make()
    c.declare("j", 0, 2)
    c.declare("j", 1, 2)
    c.on_step(rank_summary("j", 0, 9))
    c.on_step(rank_summary("j", 1, 9))
    c.on_incident(rank_finding("j", 1, 9))
    assert len(out) == 1 and out[0].status == "complete"


def test_jobs_and_steps_do_not_mix() -> None:
    c, out, clock = make()
    c.declare("a", 0, 1)
    c.declare("b", 0, 1)
    c.on_incident(rank_finding("a", 0, 1))
    c.on_step(rank_summary("b", 0, 1))
    c.on_step(rank_summary("a", 0, 2))
    assert not out
    c.on_step(rank_summary("a", 0, 1))
    assert [(i.job, i.step) for i in out] == [("a", 1)]


def test_rank_without_token_stats_gets_no_share_and_a_note() -> None:
    c, out, _ = make()
    c.declare("j", 0, 2)
    c.declare("j", 1, 2)
    c.on_incident(rank_finding("j", 0, 4))
    c.on_step(rank_summary("j", 0, 4))
    c.on_step(rank_summary("j", 1, 4, total_score=None))
    (inc,) = out
    assert [s.share for s in inc.rank_shares] == [1.0, None]
    assert "rank(s) 1 sent no token statistics" in inc.note


def test_close_all_flushes_open_incidents_as_partial() -> None:
    c, out, _ = make()
    c.declare("j", 0, 2)
    c.on_incident(rank_finding("j", 0, 5))
    c.close_all()
    assert len(out) == 1 and out[0].status == "partial" and "shut down" in out[0].note


def test_old_steps_leave_the_history_and_pending_is_bounded() -> None:
    out: list[CorrelatedIncident] = []
    c = Correlator(out.append, CorrelatorConfig(history_steps=2, max_pending=2))
    c.declare("j", 0, 2)
    for step in range(5):
        c.on_step(rank_summary("j", 0, step))
    assert list(c._recent[("j", 0)]) == [3, 4]
    for step in range(3):
        c.on_incident(rank_finding("j", 0, 10 + step))
    assert c.pending == 2 and len(out) == 1 and "closed early" in out[0].note


@pytest.mark.parametrize("kw", [dict(straggler_deadline_s=0), dict(history_steps=0), dict(max_pending=0)])
def test_config_is_validated(kw: dict) -> None:
    with pytest.raises(ConfigError):
        CorrelatorConfig(**kw)


def test_a_job_scope_finding_keeps_its_job_wide_shares_and_each_span_its_rank() -> None:
    """A multi-rank monitor localizes across the job and rank 0 sends ONE incident (scope "job"):
    its spans already carry job-wide shares and the rank that owns each; the correlator must not
    scale them by rank 0's share nor attribute them to rank 0."""
    from dataclasses import replace

    c, out, _ = make()
    for r in range(2):
        c.declare("j", r, 2)
    inc = rank_finding("j", 0, 4)
    spans = (replace(inc.localization.spans[0], share=0.6, rank=1),
             replace(inc.localization.spans[0], share=0.2, sample=1, rank=0))
    c.on_incident(replace(inc, scope="job", localization=replace(inc.localization, spans=spans)))
    c.on_step(rank_summary("j", 0, 4, total_score=1.0))
    assert not out
    c.on_step(rank_summary("j", 1, 4, total_score=3.0))
    (got,) = out
    assert [(s.rank, s.share) for s in got.spans] == [(1, 0.6), (0, 0.2)]
    assert got.status == "complete" and len(got.findings) == 1
    assert "localized across the job's ranks by rank 0" in got.note
    # A rank-scope finding from the same job is still scaled by its rank's share.
    c.on_incident(rank_finding("j", 1, 5, share=0.5))
    c.on_step(rank_summary("j", 0, 5, total_score=1.0))
    c.on_step(rank_summary("j", 1, 5, total_score=3.0))
    assert [(s.rank, s.share) for s in out[-1].spans] == [(1, 0.375)]


def test_a_job_scope_finding_heard_by_one_rank_only_closes_at_once_without_rank_shares() -> None:
    """Embedded mode in a 2-rank job: rank 0's in-process agent hears only rank 0. The job-scope
    incident already holds the job, so it closes on rank 0's step record (not after the straggler
    deadline as 'partial'), and gives no rank shares instead of a false 1.0 for rank 0."""
    from dataclasses import replace

    c, out, _ = make()
    c.declare("j", 0, 2)
    c.on_incident(replace(rank_finding("j", 0, 4), scope="job"))
    c.on_step(rank_summary("j", 0, 4))
    (got,) = out
    assert got.status == "complete" and got.ranks_missing == ()
    assert [s.share for s in got.rank_shares] == [None] and got.micro_batch_shares == ()
    assert "did not hear rank(s) 1" in got.note
    # A rank-scope finding of the same job still waits for rank 1 (then is partial).
    c.on_incident(rank_finding("j", 0, 5))
    c.on_step(rank_summary("j", 0, 5))
    assert len(out) == 1 and c.pending == 1


def test_forgotten_ranks_and_jobs_leave_nothing_behind() -> None:
    """What the agent calls for ranks and jobs silent for ``job_retention_s``."""
    c, out, _ = make()
    for job in ("ended", "running"):
        for r in range(3):
            c.declare(job, r, 3)
            c.on_step(rank_summary(job, r, 1))
    c.forget(ranks=[("running", 2)])
    assert ("running", 2) not in c._recent and c._seen["running"] == {0, 1}
    assert c._world["running"] == 3  # its declared world still names rank 2 as expected
    c.forget(jobs=["ended"])
    assert c.jobs == {"running"} and not [k for k in c._recent if k[0] == "ended"]
    # a job that comes back (a restart under the same name) starts afresh and still correlates
    c.declare("ended", 0, 1)
    c.on_incident(rank_finding("ended", 0, 2))
    c.on_step(rank_summary("ended", 0, 2))
    assert [(i.job, i.status, i.ranks_expected) for i in out] == [("ended", "complete", (0,))]


def test_a_job_with_an_open_incident_is_not_forgotten() -> None:
    c, out, clock = make(deadline=5.0)
    for r in range(2):
        c.declare("j", r, 2)
    c.on_step(rank_summary("j", 0, 3))
    c.on_incident(rank_finding("j", 0, 3))
    assert c.pending_jobs() == {"j"}
    c.forget(ranks=[("j", 0)], jobs=["j"])
    assert c.jobs == {"j"} and 3 in c._recent[("j", 0)]
    clock.t += 5.1
    c.poll()
    (inc,) = out  # closed with rank 0's step record, which forgetting would have lost
    assert inc.ranks_reported == (0,) and inc.ranks_missing == (1,)
    assert c.pending_jobs() == set()
    c.forget(jobs=["j"])
    assert c.jobs == set()
