"""One incident id (issue 33): the correlated incident is known by the id its lowest reporting rank's
trainer printed; the other ranks' finding ids are aliases; an id that is no trainer id, or one a recent
incident of another step already holds, gets a fresh id."""
from __future__ import annotations

from dataclasses import replace

from gradloc.agent.correlator import Correlator, CorrelatorConfig
from gradloc.reports import CorrelatedIncident
from tests.builders import rank_finding, rank_summary


def _close(c: Correlator, job: str, step: int, ids: dict[int, str], world: int) -> None:
    for r in range(world):
        c.declare(job, r, world)
    for r, fid in ids.items():
        c.on_incident(replace(rank_finding(job, r, step), incident_id=fid))
    for r in range(world):
        c.on_step(rank_summary(job, r, step))


def test_the_lowest_reporting_ranks_finding_id_is_the_incidents() -> None:
    out: list[CorrelatedIncident] = []
    c = Correlator(out.append, CorrelatorConfig(straggler_deadline_s=5.0))
    _close(c, "j", 7, {2: "c" * 32, 1: "b" * 32}, world=3)  # rank 0 found nothing: rank 1's id
    _close(c, "j", 8, {0: "a" * 32, 1: "d" * 32}, world=3)
    assert [i.incident_id for i in out] == ["b" * 32, "a" * 32]
    assert [f.incident_id for f in out[1].findings] == ["a" * 32, "d" * 32]  # rank 1's: an alias
    # the correlated incident's summary: its id's head and the lowest localizing rank's answer
    assert out[1].summary() == f"incident {'a' * 12} · job j · step 8: {out[1].findings[0].localization.summary()}"
    assert out[0].answer() == out[0].findings[0].localization.summary()  # rank 1's (rank 0 found nothing)


def test_an_id_that_is_no_trainer_id_or_is_taken_gets_a_fresh_one() -> None:
    out: list[CorrelatedIncident] = []
    c = Correlator(out.append, CorrelatorConfig(straggler_deadline_s=5.0))
    _close(c, "j", 7, {0: "e" * 32}, world=1)
    _close(c, "j", 8, {0: "e" * 32}, world=1)  # a client reusing an id for another step
    _close(c, "j", 9, {0: "E" * 32}, world=1)  # not the trainer's form (32 lowercase hex digits)
    _close(c, "j", 7, {0: "e" * 32}, world=1)  # the same step again (a re-delivery): the same id
    ids = [i.incident_id for i in out]
    assert ids[0] == ids[3] == "e" * 32 and len(set(ids)) == 3
    assert all(len(i) == 32 and int(i, 16) >= 0 and i == i.lower() for i in ids)
