"""docs/ARCHITECTURE.md, held: who may import whom (every import of every module, deferred ones too), and
the agent side — what the daemon runs — never imports torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "gradloc"

BASE = {"errors": set(), "config": {"errors"}, "records": {"errors"}, "reports": {"records", "errors"}}
ENGINE = ["collector", "detector", "localizer", "parallel", "engine", "adapters"]
AGENT_SIDE = {"transport", "exporters", "store", "grafana", "agent"}
ALLOWED: dict[str, set[str]] = {
    **BASE,
    **{p: {*BASE, *ENGINE[:i]} for i, p in enumerate(ENGINE)},
    "integrations": {*BASE, *ENGINE}, "demo": {*BASE, *ENGINE},
    "engine": {*BASE, *ENGINE[:4], "sinks"},
    "adapters": {*BASE, *ENGINE[:5], "sinks"},
    "sinks": {*BASE, *AGENT_SIDE},
    "transport": {*BASE, "root"},  # the root package: its __version__ (the root imports nothing eagerly)
    "exporters": {*BASE},
    "store": {*BASE},
    "grafana": {*BASE},
    "agent": {*BASE, "transport", "exporters", "store", "grafana"},
}
EXCEPTIONS = {("gradloc/agent/cli.py", "demo")}  # `gradloc-agent demo`: the trainer-side demo, inside its command


def _package(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    top = parts[1]
    return top[:-3] if top.endswith(".py") else top


def _imports() -> list[tuple[str, str, str]]:
    """(file, its package, imported package) for every gradloc import (module-level and deferred)."""
    out = []
    for path in PKG.rglob("*.py"):
        if "_generated" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
        src = _package(mod) if mod.count(".") else "root"
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gradloc":
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "gradloc"]
            out += [(rel, src, _package(n)) for n in names if _package(n) != src]
    return out


def test_every_import_goes_the_allowed_direction():
    seen = _imports()
    assert len(seen) > 100  # the scan found the code
    bad = sorted({(f, s, t) for f, s, t in seen if (f, t) not in EXCEPTIONS and t not in ALLOWED.get(s, set())})
    assert bad == [], "imports against docs/ARCHITECTURE.md: " + "; ".join(f"{f}: {s} -> {t}" for f, s, t in bad)


def test_the_agent_side_never_imports_the_engine_side():
    engine = {*ENGINE, "integrations", "demo", "sinks"}
    bad = [(f, t) for f, s, t in _imports() if s in AGENT_SIDE and t in engine and (f, t) not in EXCEPTIONS]
    assert bad == []


def test_the_daemon_never_imports_torch():
    """Every agent-side module in a fresh interpreter: torch stays out (the daemon's memory budget)."""
    modules = sorted(p.relative_to(ROOT).as_posix()[:-3].replace("/", ".").removesuffix(".__init__")
                     for side in AGENT_SIDE for p in (PKG / side).rglob("*.py") if "_generated" not in p.parts)
    code = ("import sys, importlib\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(len(sys.modules), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False", f"torch imported by the agent side ({len(modules)} modules)"
