"""Escaping what the agent renders: every string in an incident came from a client.

Token text is training data and can hold anything: terminal escape sequences (``\\x1b]0;…\\x07``
retitles a terminal, ``\\x1b[2J`` clears it), C1 controls (``\\x9b`` is a CSI on some terminals),
bidirectional overrides (U+202E makes text read backwards), NULs. Rendered, each is shown as an
escape (``\\x1b``, ``\\u202e``) instead of acting:

- :func:`terminal` for text output, keeping gradloc's own four colour codes and line breaks;
- :func:`json_text` for JSON printed or served: ``json.dumps`` already escapes C0 controls, this
  also escapes C1 controls, DEL and the bidi/zero-width format characters (still valid JSON);
- HTML (the incident page) escapes with ``html.escape`` on top of :func:`visible`.
"""
from __future__ import annotations

import json
import re
from typing import Any

from gradloc.records.summary import MIN_CHAR_RUN, repeats  # noqa: F401 - the run finder, shared with the one-line summary

COLOURS = ("\x1b[1;97;41m", "\x1b[2m", "\x1b[1m", "\x1b[0m")  # render.py's own: highlight, dim, bold, off
_BAD = "\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2028\u2029\u2060-\u2064\u2066-\u2069\ufeff"
_CONTROL = re.compile(f"[{_BAD}\t\n]")
_TERMINAL = re.compile("(" + "|".join(map(re.escape, COLOURS)) + f")|([{_BAD}\t])")
_JSON = re.compile(f"[{_BAD}]")
_NAMED = {"\n": "\\n", "\t": "\\t"}


def _esc(ch: str) -> str:
    code = ord(ch)
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def visible(text: str | None) -> str:
    """One piece of client text (a token, its context) with every control/format character escaped."""
    return "?" if text is None else _CONTROL.sub(lambda m: _esc(m.group(0)), text)


def visible_runs(text: str | None) -> str:
    """:func:`visible` with each run of :func:`repeats` written once with its count: ``⟨121 × \\x00⟩``."""
    if text is None:
        return visible(text)
    return "".join(visible(piece) if n == 1 else f"⟨{n} × {visible(piece)}⟩" for piece, n in repeats(text))


def terminal(text: str) -> str:
    """A rendered block: control characters escaped, except gradloc's own colour codes and line breaks."""
    return _TERMINAL.sub(lambda m: m.group(1) or _esc(m.group(2)), text)


def json_text(payload: Any, **kw: Any) -> str:
    """``json.dumps(payload, ensure_ascii=False)`` with C1/DEL/bidi characters as \\u escapes."""
    return _JSON.sub(lambda m: f"\\u{ord(m.group(0)):04x}", json.dumps(payload, ensure_ascii=False, **kw))
