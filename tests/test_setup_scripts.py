"""The README's two commands: the demo's set-up is light (scripts/setup_demo.sh), the test command's is everything
(scripts/setup.sh, which .ci/run runs verbatim), and a set-up whose inputs did not change does nothing.

The scripts run for real in a scratch copy, with a stand-in ``.venv/bin/python`` that records its arguments: what
is checked is the scripts' own logic (which installs they ask for, when), not pip (a real fresh install takes
minutes and a network; its timing is in the issue-33 report and the README).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_commands_and_ci() -> None:
    demo, tests = _bash_blocks((ROOT / "README.md").read_text())[:2]
    assert demo == "bash scripts/setup_demo.sh && .venv/bin/gradloc-agent demo"
    assert tests == "bash scripts/setup.sh && .venv/bin/python -m pytest -q -n 2 --dist loadgroup"
    assert (ROOT / ".ci/run").read_text().strip().splitlines()[-1] == tests
    full = (ROOT / "scripts/setup.sh").read_text()
    assert "bash scripts/setup_demo.sh" in full  # the test set-up includes the demo's


def test_the_demo_setup_installs_only_the_demo_extra() -> None:
    text = (ROOT / "scripts/setup_demo.sh").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for heavy in ("apt-get", "setup_vllm", "setup_verl", "deepspeed", "megatron", "openrlhf", "[demo,"):
        assert heavy not in code, heavy
    assert '-e ".[demo]"' in code and "-c constraints.txt" in code


def _scratch(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of what setup_demo.sh reads, with a stand-in .venv/bin/python that logs its arguments."""
    for name in ("pyproject.toml", "constraints.txt", "scripts/setup_demo.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    log = tmp_path / "calls.log"
    python = tmp_path / ".venv/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    python.chmod(0o755)
    return tmp_path, log


def _run(root: Path) -> None:
    res = subprocess.run(["bash", "scripts/setup_demo.sh"], cwd=root, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_the_demo_setup_is_idempotent_and_reruns_when_its_inputs_change(tmp_path: Path) -> None:
    root, log = _scratch(tmp_path)
    _run(root)
    calls = log.read_text().splitlines()
    assert calls == ['-m pip install --quiet --no-compile -c constraints.txt -e .[demo]'], calls
    _run(root)  # nothing changed: no install
    assert log.read_text().splitlines() == calls
    with open(root / "constraints.txt", "a") as fh:
        fh.write("# changed\n")
    _run(root)  # a changed input: installs again
    assert len(log.read_text().splitlines()) == 2
