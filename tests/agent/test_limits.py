"""The daemon's per-job incident limits (gradloc/agent/limits.py), on an injected clock."""
from __future__ import annotations

from dataclasses import replace

from gradloc.agent.limits import IncidentLimits
from tests.builders import incident_record


def _limits(per_minute: int = 3, max_culprits: int = 1):
    counted: list[tuple[str, int]] = []
    now = [0.0]
    lim = IncidentLimits(per_minute, max_culprits, lambda what, n: counted.append((what, n)), clock=lambda: now[0])
    return lim, counted, now


def test_rate_per_job_is_a_token_bucket_and_drops_are_counted() -> None:
    lim, counted, now = _limits()
    a = tuple(replace(incident_record(i), job="a") for i in range(5))
    kept = lim.admit(a)
    assert [i for i, _ in kept] == [0, 1, 2]  # the burst: one minute's worth; positions are the batch's
    assert counted == [("incident_rate", 1), ("incident_rate", 1)]
    assert [i for i, _ in lim.admit((replace(incident_record(9), job="b"),))] == [0]  # another job has its own
    now[0] = 20.0  # a third of a minute refills one
    assert len(lim.admit(a)) == 1


def test_culprits_beyond_the_limit_are_cut_with_a_note() -> None:
    lim, counted, _ = _limits(per_minute=100, max_culprits=1)
    inc = incident_record(1)
    loc = inc.localization
    many = replace(inc, localization=replace(loc, culprits=loc.culprits * 3, spans=loc.spans * 3))
    (_, kept), = lim.admit((many,))
    assert len(kept.localization.culprits) == 1 and len(kept.localization.spans) == 1
    assert "kept the first 1 of 3 culprits" in kept.localization.note
    assert counted == [("culprits", 1)]
    (_, same), = lim.admit((inc,))  # within the limit: untouched
    assert same == inc
