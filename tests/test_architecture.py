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
EXCEPTIONS = {("gradloc/agent/cli.py", "demo"),  # `gradloc-agent demo`: the trainer-side demo, inside its command
              ("gradloc/integrations/quarantine.py", "store")}  # QuarantineList.from_store reads the store's list


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


def test_the_exceptions_import_inside_a_function_only():
    """docs/ARCHITECTURE.md's two exceptions (`gradloc-agent demo`; the quarantine helper's ``from_store``) import
    inside their function, never at module level: the agent CLI loads without the trainer side, the loader helper
    without the store."""
    for rel, target in EXCEPTIONS:
        tree = ast.parse((ROOT / rel).read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module] + \
            [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        assert not [n for n in names if _package(n) == target], (rel, target)


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


# -- the engine never names a backend (issue 34): only parallel/ knows which parallelism a job has ----------------
# the builders of jobs are exempt: the demo and its CLI construct DDP/FSDP/DeepSpeed/TP/PP jobs by name
NAMES_ALLOWED = ("gradloc/parallel/", "gradloc/demo/", "gradloc/agent/cli.py")


def _backend_names() -> set[str]:
    from gradloc.parallel.backend import backends
    from gradloc.parallel.job import _load_backends

    _load_backends()
    return (set(backends()) | {"single"}) - {"none"}  # "none" (a data group of one rank) is any setting's word too


def _branches_on_backends(path: Path, names: set[str], classes: set[str]) -> list[str]:
    """Comparisons against a backend's name or a job's ``kind``, and isinstance checks of a backend class."""
    tree, out = ast.parse(path.read_text()), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for o in operands:
                consts = [o] if isinstance(o, ast.Constant) else list(getattr(o, "elts", []))
                hit = [c.value for c in consts if isinstance(c, ast.Constant) and c.value in names]
                kind = isinstance(o, ast.Attribute) and o.attr in ("kind", "job_kind") and \
                    "job" in ast.unparse(o.value)
                if hit or kind:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
                    break
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            targets = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(ast.unparse(t).split(".")[-1] in classes for t in targets):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "part":
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)} (a backend looked up by name)")
    return out


def test_no_module_outside_parallel_branches_on_a_backend():
    """docs/ARCHITECTURE.md: the job (parallel/) supplies the collector, the probe scope, the step checks and the
    pipeline step; nothing else compares against a backend's name, a job's kind, or isinstance-checks a backend."""
    from gradloc.parallel.backend import backends

    names = _backend_names()
    classes = {c.__name__ for c in backends().values()} | {"Backend", "DataBackend", "ModelBackend"}
    assert {"ddp", "fsdp", "deepspeed", "pp", "tp", "ep"} <= names and "DeepSpeed" in classes  # the scan knows them
    bad = [hit for path in sorted(PKG.rglob("*.py")) if "_generated" not in path.parts
           and not path.relative_to(ROOT).as_posix().startswith(NAMES_ALLOWED)
           for hit in _branches_on_backends(path, names, classes)]
    assert bad == [], "branches on a backend outside parallel/: " + "; ".join(bad)


def test_the_backend_check_finds_a_branch():
    """The check itself: a module that compares a job's kind, a backend's name, or isinstance-checks one is caught."""
    import tempfile

    src = ("def f(job, mon, x):\n"
           "    if job.kind == 'deepspeed': pass\n"
           "    if mon.job_kind in ('single', 'ddp'): pass\n"
           "    if isinstance(x, DeepSpeed): pass\n"
           "    return job.part('pp')\n")
    with tempfile.NamedTemporaryFile("w", suffix=".py", dir=ROOT, delete=False) as f:
        f.write(src)
    path = Path(f.name)
    try:
        hits = _branches_on_backends(path, _backend_names(), {"DeepSpeed"})
    finally:
        path.unlink()
    assert len(hits) == 4, hits


# -- no import cycles (issue 34): every import of every module, deferred and TYPE_CHECKING ones too ---------------
def _module_edges(root: Path, top: str) -> dict[str, set[str]]:
    """module -> the modules of ``top`` it imports (resolved to a file of the tree: a package's __init__ or a module)."""
    files = {p.relative_to(root).as_posix()[:-3].replace("/", ".").removesuffix(".__init__"): p
             for p in (root / top).rglob("*.py") if "_generated" not in p.parts}
    edges: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]  # an imported name: its module
                if t and t != mod and not mod.startswith(t + "."):  # a package's own __init__ is not a cycle
                    edges[mod].add(t)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_in_gradloc_or_bench():
    """Every import counts (module-level, deferred inside functions, under TYPE_CHECKING): a cycle is two modules
    that need each other, whenever the import runs."""
    for top in ("gradloc", "bench"):
        edges = _module_edges(ROOT, top)
        assert len(edges) > 20 and sum(map(len, edges.values())) > 20, top  # the scan found the code
        assert _cycles(edges) == [], f"import cycles in {top}/: {_cycles(edges)}"


def test_the_cycle_check_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(edges) == [["a", "b", "c"]]


LEVELS = ("tokens", "below", "sample_probes", "ranks", "prune", "naming", "bisect_step", "trail")  # localizer/: functions of the runner


def _level_problems(path: Path) -> list[str]:
    """What makes a localizer level more than a function of the runner and frozen values: a class that is not a
    frozen dataclass, an import of the driver (localizer.py), or a private attribute of another object."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            frozen = any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass"
                         and any(k.arg == "frozen" and getattr(k.value, "value", False) for k in d.keywords)
                         for d in node.decorator_list)
            if not frozen:
                out.append(f"class {node.name} (not a frozen dataclass)")
        elif isinstance(node, ast.ImportFrom) and node.module == "gradloc.localizer.localizer":
            out.append("imports localizer.py")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            out.append(f"reads .{node.attr}")
    return out


def test_the_localizer_levels_are_functions_of_the_runner_and_frozen_values():
    problems = {m: p for m in LEVELS if (p := _level_problems(PKG / "localizer" / f"{m}.py"))}
    assert not problems, problems


def test_the_level_check_finds_a_stateful_level(tmp_path: Path):
    bad = tmp_path / "level.py"
    bad.write_text("from dataclasses import dataclass\n"
                   "from gradloc.localizer.localizer import run\n"
                   "@dataclass(frozen=True)\nclass Ok:\n    x: int\n"
                   "class Level:\n    def __init__(self, r):\n        self.n = r._used\n")
    assert sorted(_level_problems(bad)) == ["class Level (not a frozen dataclass)", "imports localizer.py",
                                            "reads ._used"]


MAX_LINES = 340  # "modules around 300 lines or less": a module past this is split, not grown


def test_modules_stay_around_300_lines():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
             for top in ("gradloc", "bench") for p in (ROOT / top).rglob("*.py") if "_generated" not in p.parts}
    assert len(sizes) > 100, len(sizes)
    over = {m: n for m, n in sizes.items() if n > MAX_LINES}
    assert not over, f"split these modules (over {MAX_LINES} lines): {over}"


def test_every_test_module_has_its_own_name():
    """pytest's rootdir import mode imports a test module outside a package by its basename: two such ``test_x.py``
    in different folders stop the whole run at collection (it did, twice, in issue 35's work)."""
    from collections import Counter

    # a module in a folder without __init__.py is imported by its basename alone (in a package: by its dotted path)
    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py") if not (p.parent / "__init__.py").exists())
    assert [n for n, k in names.items() if k > 1] == []
