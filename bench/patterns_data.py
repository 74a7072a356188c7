"""The data of ``python -m bench patterns``: four real text sources as HF ``datasets``, rows that name their file
and line, and faults that belong to rows (bench/patterns.py trains on them).

Every row is one window of ``seq + 1`` bytes of a file found offline on the machine (nothing is downloaded), and
its origin is ``"<path>:<line>"`` — the line the window starts at — so a flag can be followed back to the file:
:func:`resolve` re-reads the file and gives the window's bytes again (the benchmark checks that every flagged
origin resolves to the row that was trained on). The kinds are samples_text's:

- ``prose``: docstrings of the standard library (the line of the docstring's opening quotes; the window is the
  docstring's text as ``ast.get_docstring`` gives it);
- ``legal``: Debian's licence texts (``/usr/share/common-licenses``);
- ``code``: the standard library's Python sources;
- ``markup``: man pages (groff, the line of the decompressed page) and HTML / markdown under ``/usr/share/doc``.

Faults are properties of rows, as in a real shard, so a faulty row is faulty every time it is drawn: one or two
sources (chosen by the seed) get ``fault_rate`` of their rows corrupted, the fault kinds taking turns:
``garbage`` (random bytes: a binary blob in a text shard), ``mis_decoded`` (UTF-16 text read one byte per
character: every other byte a NUL) and ``mis_labelled`` (the labels are the inputs: the row was tokenized by a
script that forgot the shift). The ground truth is the set of faulty origins.
"""
from __future__ import annotations

import ast
import functools
import gzip
import os
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("prose", "legal", "code", "markup")
FAULTS = ("garbage", "mis_decoded", "mis_labelled")
LICENSES = Path("/usr/share/common-licenses")
_SKIP = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo"}


def _read(path: Path) -> bytes | None:
    """A file's bytes (a ``.gz`` decompressed); None when unreadable or not UTF-8 text."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    return raw


def _line_windows(path: Path, size: int) -> list[tuple[str, bytes]]:
    """Non-overlapping windows of ``size`` bytes of one file, each starting at a non-blank line: (origin, bytes)."""
    raw = _read(path)
    if raw is None:
        return []
    out, at, end = [], 0, 0
    for n, line in enumerate(raw.split(b"\n"), 1):
        if at >= end and line.strip() and at + size <= len(raw):
            out.append((f"{path}:{n}", raw[at:at + size]))
            end = at + size
        at += len(line) + 1
    return out


def _docstrings(path: Path) -> list[tuple[int, str]]:
    """(line of the docstring's opening quotes, the docstring) of a Python file's module, classes and functions."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def _stdlib_files(limit: int) -> list[Path]:
    root, out, size = sysconfig.get_paths()["stdlib"], [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP)
        for name in sorted(filenames):
            p = Path(dirpath, name)
            if name.endswith(".py") and size < limit and not p.is_symlink():
                out.append(p)
                size += p.stat().st_size
    return out


def _markup_files(limit: int) -> list[Path]:
    man = sorted(p for d in sorted(Path("/usr/share/man").glob("man[1-8]")) for p in d.glob("*.gz"))
    doc = sorted(p for p in Path("/usr/share/doc").rglob("*") if p.suffix in (".html", ".md") and p.is_file())
    out, size = [], 0
    for i in range(max(len(man), len(doc))):
        for paths in (man, doc):
            if i < len(paths) and size < limit and not paths[i].is_symlink():
                out.append(paths[i])
                size += paths[i].stat().st_size * (4 if paths[i].suffix == ".gz" else 1)
    return out


@functools.lru_cache(maxsize=2)
def candidates(size: int, limit: int = 3_000_000) -> dict[str, list[tuple[str, bytes]]]:
    """Every window of ``size`` bytes each kind offers (at most ~``limit`` bytes of files per kind), in file order."""
    out: dict[str, list[tuple[str, bytes]]] = {k: [] for k in KINDS}
    for p in _stdlib_files(limit):
        out["code"] += _line_windows(p, size)
        out["prose"] += [(f"{p}:{n}", d.encode()[:size]) for n, d in _docstrings(p) if len(d.encode()) >= size]
    for p in sorted(LICENSES.iterdir()) if LICENSES.is_dir() else ():
        if p.is_file() and not p.is_symlink():
            out["legal"] += _line_windows(p, size)
    for p in _markup_files(limit):
        out["markup"] += _line_windows(p, size)
    return out


def resolve(kind: str, origin: str, size: int) -> bytes | None:
    """The ``size`` bytes an origin names, read again from its file (None: no such file, line or docstring)."""
    path, _, line = origin.rpartition(":")
    if not line.isdigit():
        return None
    n = int(line)
    if kind == "prose":
        docs = dict(_docstrings(Path(path)))
        return docs[n].encode()[:size] if n in docs else None
    raw = _read(Path(path))
    if raw is None:
        return None
    lines = raw.split(b"\n")
    if not 1 <= n <= len(lines):
        return None
    at = sum(len(s) + 1 for s in lines[:n - 1])
    return raw[at:at + size] if at + size <= len(raw) else None


@dataclass
class Mixture:
    """One seed's rows: per kind, the chosen (origin, clean bytes); the faulty origins and their fault kind."""

    rows: dict[str, list[tuple[str, bytes]]]
    faulty_sources: tuple[str, ...]
    faults: dict[str, str] = field(default_factory=dict)  # origin -> fault kind (the ground truth)
    seed: int = 0

    @property
    def origins(self) -> dict[str, str]:
        """origin -> source, for every row."""
        return {o: k for k, rows in self.rows.items() for o, _ in rows}

    def window(self, origin: str, gen: random.Random) -> tuple[list[int], list[int]]:
        """(input ids, labels) of a row as it is trained on: its fault applied, the same every time it is drawn."""
        clean = self._clean[origin]
        fault = self.faults.get(origin)
        seq = len(clean) - 1
        if fault == "garbage":
            data = bytes(gen.randrange(256) for _ in range(seq + 1))
        elif fault == "mis_decoded":
            data = clean.decode("utf-8", errors="replace").encode("utf-16-le")[:seq + 1]
        else:
            data = clean
        ids = list(data)
        if fault == "mis_labelled":
            return ids[:-1], ids[:-1]
        return ids[:-1], ids[1:]

    def __post_init__(self) -> None:
        self._clean = {o: b for rows in self.rows.values() for o, b in rows}


def pick(seed: int, rows_per_source: int, seq: int, fault_rate: float, n_faulty: int | None = None,
         limit: int = 3_000_000) -> Mixture:
    """``rows_per_source`` random windows of each kind, and the faulty rows: ``round(fault_rate × rows)`` of each
    faulty source (one source on odd seeds, two on even ones unless ``n_faulty`` says), fault kinds in turn."""
    rng = random.Random(seed)
    pool = candidates(seq + 1, limit)
    rows = {}
    for k in KINDS:
        if len(pool[k]) < rows_per_source:
            raise RuntimeError(f"only {len(pool[k])} windows of {k} text on this machine, {rows_per_source} asked")
        rows[k] = sorted(rng.sample(pool[k], rows_per_source))
    n = n_faulty if n_faulty is not None else (2 if seed % 2 == 0 else 1)
    faulty = tuple(sorted(rng.sample(KINDS, n)))
    faults: dict[str, str] = {}
    turn = rng.randrange(len(FAULTS))
    for k in faulty:
        for origin, _ in rng.sample(rows[k], max(1, round(fault_rate * rows_per_source))):
            faults[origin] = FAULTS[turn % len(FAULTS)]
            turn += 1
    return Mixture(rows, faulty, faults, seed)


def held_out(mix: Mixture, seq: int, limit: int = 3_000_000) -> dict[str, list[bytes]]:
    """Per kind, the clean windows the mixture did not take (by origin, nor a copy of one's bytes elsewhere: the
    licences and docs repeat themselves): the pre-training text, the same kinds of text but other rows."""
    taken = {b for rows in mix.rows.values() for _, b in rows}
    return {k: [b for o, b in rows if b not in taken] for k, rows in candidates(seq + 1, limit).items()}


def dataset(mix: Mixture) -> Any:
    """The mixture as one HF ``datasets.Dataset``: one dataset per source through ``with_provenance`` (the origin
    column is the file and line), concatenated; columns ``input_ids``, ``labels`` and the provenance columns."""
    import datasets

    from gradloc.integrations.provenance import with_provenance

    gen = random.Random(mix.seed * 7919 + 1)  # garbage bytes: drawn once per row, then fixed
    parts = []
    for kind, rows in mix.rows.items():
        windows = [mix.window(o, gen) for o, _ in rows]
        ds = datasets.Dataset.from_dict({"input_ids": [w[0] for w in windows], "labels": [w[1] for w in windows],
                                         "origin": [o for o, _ in rows]})
        parts.append(with_provenance(ds, source=kind, origin_column="origin").remove_columns("origin"))
    return datasets.concatenate_datasets(parts)


__all__ = ["FAULTS", "KINDS", "Mixture", "candidates", "dataset", "held_out", "pick", "resolve"]
