"""AgentCore settles the inbox row of every incident it fed to the correlator, including one the
correlator replaced (a later incident of the same job, step and rank). Found by the daemon fuzz
(tests/reliability/test_fuzz.py): a batch that carried an incident twice left the replaced rows
open, and every restart of the daemon correlated them again and stored the incident once more.
Real components: AgentCore, Correlator, an IncidentStore on a temp file."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from gradloc.agent.core import AgentCore, CoreConfig, Declare, Journaled
from gradloc.agent.correlator import CorrelatorConfig
from gradloc.store.incident_json import incident_to_json
from gradloc.store.sqlite import IncidentStore
from tests.builders import BELL, T0, finding

WHO = ("llm-7b", 0, 2)  # the fixtures' job, 2 ranks


def _inc(rank: int, step: int, incident_id: str):
    return replace(finding(rank, step, BELL, incident_id="", time_unix=T0 + step), incident_id=incident_id)


def _run_core(db: Path, items: list) -> None:
    core = AgentCore(CoreConfig(correlator=CorrelatorConfig(straggler_deadline_s=30.0)), IncidentStore(db))
    core.start()
    assert core.submit([Declare(*WHO), *items], timeout_s=5.0)
    core.close(timeout_s=10.0)  # closes the open incident (partial: rank 1 never reported) and the store


def _stored(db: Path) -> list[str]:
    with IncidentStore(db) as store:
        return [f.incident_id for inc in store.iter_incidents() for f in inc.findings]


def test_an_incident_replaced_in_the_correlator_has_its_inbox_row_settled(tmp_path: Path) -> None:
    db = tmp_path / "agent.db"
    first, again = _inc(0, 1200, "a" * 32), _inc(0, 1200, "b" * 32)  # the same rank and step, reported twice
    with IncidentStore(db) as store:
        assert store.inbox_put("c1", 1, WHO, [(0, incident_to_json(first)), (1, incident_to_json(again))]) == [0, 1]
        assert store.inbox_put("c1", 2, WHO, [(0, incident_to_json(first))]) == [0]  # re-sent under a new sequence
    _run_core(db, [Journaled(first, ("c1", 1, 0)), Journaled(again, ("c1", 1, 1)), Journaled(first, ("c1", 2, 0))])
    assert _stored(db) == ["a" * 32]  # the correlator keeps the rank's latest incident (first, re-sent), once
    with IncidentStore(db) as store:
        assert store.inbox_pending() == []  # all three rows settled with it
    _run_core(db, [])  # a restart: nothing to correlate again
    assert _stored(db) == ["a" * 32]


def test_incidents_of_other_ranks_and_steps_keep_their_own_rows(tmp_path: Path) -> None:
    db = tmp_path / "agent.db"
    ours, other_rank, later = _inc(0, 1200, "a" * 32), _inc(1, 1200, "b" * 32), _inc(0, 1300, "c" * 32)
    with IncidentStore(db) as store:
        store.inbox_put("c1", 1, WHO, list(enumerate(incident_to_json(i) for i in (ours, other_rank, later))))
    _run_core(db, [Journaled(i, ("c1", 1, k)) for k, i in enumerate((ours, other_rank, later))])
    assert sorted(_stored(db)) == ["a" * 32, "b" * 32, "c" * 32]
    with IncidentStore(db) as store:
        assert store.inbox_pending() == []
