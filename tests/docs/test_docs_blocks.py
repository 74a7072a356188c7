"""Every ```python block of README.md and docs/your-model.md runs against the installed package, so the
docs cannot drift from what a user gets.

A block runs in a fresh namespace built by the setup its marker names (tests/docs/setups.py: the
names the block takes as given, for real: the demo's model and data, a tiny Llama), in a temporary
working directory; the setup's check then judges what it left and printed. A block with no marker runs
as is. ``<!-- docs-test: skip (REASON) -->`` marks a block that needs what no test machine here has (a
GPU, a cluster, a running daemon on a fixed port); the reason is shown as the skip reason.
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from tests.docs.setups import CHECKS, SETUPS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/your-model.md")
MARKER = re.compile(r"<!-- docs-test: (?:setup=(?P<setup>[\w-]+)|skip \((?P<skip>[^)]+)\)) -->")
FENCE = re.compile(r"^```python\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(doc: str) -> list[tuple[str, str | None, str | None, str]]:
    """(id, setup, skip reason, code) of each python block; the marker is the last non-blank line above it."""
    text = (ROOT / doc).read_text()
    out = []
    for k, m in enumerate(FENCE.finditer(text)):
        above = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARKER.fullmatch(above.strip())
        if above.strip().startswith("<!-- docs-test") and mark is None:
            raise ValueError(f"{doc} block {k}: malformed marker {above!r}")
        line = text.count("\n", 0, m.start()) + 1
        out.append((f"{doc}:{line}", mark and mark["setup"], mark and mark["skip"], m["code"]))
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]


def test_the_docs_have_python_blocks_and_every_setup_is_known() -> None:
    assert {doc for doc in DOCS if any(b[0].startswith(doc + ":") for b in ALL)} == set(DOCS)
    assert {b[1] for b in ALL if b[1]} <= set(SETUPS), "a marker names a setup tests/docs/setups.py lacks"


@pytest.mark.parametrize(("where", "setup", "skip", "code"), ALL, ids=[b[0] for b in ALL])
def test_docs_block_runs(where: str, setup: str | None, skip: str | None, code: str, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    if skip:
        pytest.skip(skip)
    monkeypatch.chdir(tmp_path)
    ns = SETUPS[setup](tmp_path) if setup else {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), ns)  # noqa: S102 - the documented code, run as a reader would
    print(out.getvalue())
    if setup in CHECKS:
        CHECKS[setup](ns, out.getvalue())
