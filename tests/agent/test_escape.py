"""Client text rendered by the agent cannot act on a terminal or a JSON reader (gradloc/agent/escape.py)."""
from __future__ import annotations

import json
from dataclasses import replace

from gradloc.agent.escape import COLOURS, json_text, terminal
from gradloc.agent.render import incident_line, incident_text
from tests.builders import incident_record

EVIL = "\x1b]0;pwned\x07\x1b[2J\u202etxt\x9b31m\x00\x7f\u200b\n\tend"
RAW = ("\x1b", "\x07", "\u202e", "\x9b", "\x00", "\x7f", "\u200b")


def _evil_incident():
    inc = incident_record(3)
    loc = inc.localization
    span = replace(loc.spans[0], text=EVIL, context_before=EVIL, context_after=EVIL, sample_id=EVIL)
    cul = replace(loc.culprits[0], text=EVIL, sample_id=EVIL)
    return replace(inc, job="job" + EVIL, localization=replace(loc, spans=(span,), culprits=(cul,), note=EVIL))


def test_terminal_output_has_no_raw_control_characters() -> None:
    for color in (True, False):
        text = incident_text(_evil_incident(), color=color)
        stripped = text
        for code in COLOURS:
            stripped = stripped.replace(code, "")
        assert not any(ch in stripped for ch in RAW), repr(stripped)
        assert "\\x1b]0;pwned\\x07" in text and "\\u202e" in text and "\\x9b" in text
    line = incident_line(_evil_incident())
    assert not any(ch in line for ch in RAW)
    summary = _evil_incident().summary()  # what the README's recipe prints, outside any renderer
    assert not any(ch in summary for ch in RAW) and "\\x1b]0;pwned" in summary, summary


def test_terminal_keeps_only_gradlocs_own_colours() -> None:
    assert terminal("\x1b[1mok\x1b[0m\x1b[31m") == "\x1b[1mok\x1b[0m\\x1b[31m"


def test_json_is_valid_and_escapes_c1_and_bidi() -> None:
    text = json_text({"t": EVIL})
    assert json.loads(text) == {"t": EVIL}
    assert not any(ch in text for ch in RAW)


def test_runs_of_repeats_are_shown_once_with_their_count():
    """Issue 33's bad input (a sample of 10,000 identical tokens): one "N × unit", in the terminal as on the page."""
    from gradloc.agent.escape import MIN_CHAR_RUN, repeats, visible_runs

    assert repeats("ab" + "\x00" * 10_000 + "cd") == [("ab", 1), ("\x00", 10_000), ("cd", 1)]
    assert repeats("xy" * MIN_CHAR_RUN) == [("xy", MIN_CHAR_RUN)]
    assert repeats("xy" * (MIN_CHAR_RUN - 1)) == [("xy" * (MIN_CHAR_RUN - 1), 1)]  # too few: as written
    assert visible_runs("a" + "\x1b" * 9) == "a⟨9 × \\x1b⟩" and visible_runs(None) == "?"


def test_the_cli_prints_a_flood_of_identical_tokens_as_one_count():
    from gradloc.agent.render_correlated import correlated_text
    from tests.builders import flooded_incident

    text = correlated_text(flooded_incident(), color=False)
    assert "…⟨4939 × \\x00⟩[[⟨121 × \\x00⟩]]⟨4940 × \\x00⟩…" in text
    assert max(len(line) for line in text.splitlines()) < 300 and "\x00" not in text
