"""``Localization.summary()`` / ``Incident.summary()``: the answer in one line at its level (issue 33), the
line the README's recipe prints and the demo and ``incidents show`` lead with."""
from __future__ import annotations

from dataclasses import replace

import pytest

from gradloc.records import CulpritGroup, SampleShare
from tests.builders import rank_finding

F = rank_finding("j", 0, 5)  # a token at micro-batch 1 · sample 0 · position 7, ' bad', 80% of ‖∇‖², 1 probe
LOC = F.localization


def test_token_level_names_the_token_its_share_and_probes() -> None:
    assert replace(F, incident_id="ab" * 16).summary() == (
        "incident abababababab · job j · step 5: located at the token level: micro-batch 1 · sample 0 (id s0) · "
        "position 7 ' bad' · 80.0% of ‖∇‖² · 1 probe(s)")


@pytest.mark.parametrize(("level", "change", "named"), [
    ("span", dict(spans=(replace(LOC.spans[0], end=12, text=" a bad run"),)),
     "located at the span level: micro-batch 1 · sample 0 (id s0) · positions 7–11 ' a bad run'"),
    ("sample", dict(spans=(), samples=(SampleShare(micro_batch=2, sample=3, score_share=0.9, share=0.94, tokens=56),)),
     "located at the sample level: micro-batch 2 · sample 3 (56 loss tokens)"),
    ("micro_batch", dict(spans=(), groups=(CulpritGroup(share=0.9, micro_batch=2, samples=4, tokens=220),)),
     "located at the micro-batch level: micro-batch 2 (4 samples, 220 loss tokens)"),
    ("rank", dict(spans=(), groups=(CulpritGroup(share=0.9, rank=1, micro_batches=4, samples=16, tokens=900),)),
     "located at the rank level: rank 1 (all 4 micro-batches, 16 samples, 900 loss tokens)"),
])
def test_each_level_names_what_it_found(level: str, change: dict, named: str) -> None:
    s = replace(LOC, level=level, passes=2, **change).summary()
    assert s == f"{named} · 80.0% of ‖∇‖² · 1 probe(s) (+2 extra pass(es))"


def test_more_culprits_are_counted_and_a_run_of_one_character_is_collapsed() -> None:
    run = replace(LOC.spans[0], start=0, end=121, text="\x00" * 121)
    s = replace(LOC, level="span", spans=(run, LOC.spans[0])).summary()
    assert "positions 0–120 121 × '\\x00' (+1 more) · 80.0%" in s and "\x00" not in s
    long = replace(LOC.spans[0], text="\x1b[2J" + "x" * 80)
    s = replace(LOC, spans=(long,)).summary()
    assert "'\\x1b[2J" in s and "\x1b" not in s and "…'" in s  # escaped, cut


def test_diffuse_unverified_unavailable_say_so() -> None:
    diffuse = replace(LOC, status="diffuse", level="", spans=(), explained_share=None, probes=3).summary()
    assert diffuse == "diffuse: no token, span, sample or micro-batch carries the spike · 3 probe(s)"
    unverified = replace(LOC, status="unverified", explained_share=None, probes=0).summary()
    assert unverified.endswith("· shares attributed, not measured (no probe closure) · 0 probe(s)")
    gone = replace(LOC, status="unavailable", level="", spans=(), explained_share=None, probes=0,
                   note="no per-token statistics").summary()
    assert gone == "unavailable · 0 probe(s) · no per-token statistics"
    assert replace(F, localization=None).summary().endswith(": grad_spike · not localized (a trend, not a token event)")


def test_a_job_scope_incident_names_the_rank_of_its_culprit() -> None:
    inc = replace(F, scope="job", localization=replace(LOC, spans=(replace(LOC.spans[0], rank=3),)))
    assert ": located at the token level: rank 3 · micro-batch 1 · sample 0" in inc.summary()
