"""Two benchmark JSONs, the same verdicts? ``python -m bench compare BASELINE.json NEW.json [--ignore KEY ...]``.

A refactor must not change what gradloc finds: issue 34's target is the same verdicts, levels, shares (to 1e-6)
and probe counts from ``python -m bench localization --json`` (and ``--rl``, ``--faults``) before and after. This
walks both JSON documents together and prints every leaf that differs — a string, a count, a list's length, a
float by more than ``--tol`` (absolute, default 1e-6) — with its path; exit status 1 when any does. Timings and
the machine's load (``wall_s``, ``seconds``, ``loadavg_1m`` …) are ignored by default, and any other key can
be (``--ignore note``). The baselines recorded before the redesign are in ``bench/baselines/``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Iterator

TIMINGS = frozenset({"wall_s", "seconds", "loadavg_1m", "load", "elapsed_s", "time_s", "train_s"})


def diff(a: Any, b: Any, tol: float, ignore: frozenset[str], path: str = "") -> Iterator[str]:
    """Every leaf where ``a`` and ``b`` differ, as 'path: a != b'."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k in ignore:
                continue
            if k not in a or k not in b:
                yield f"{path}.{k}: {'missing' if k not in a else 'present'} in the baseline, " \
                      f"{'missing' if k not in b else 'present'} in the new run"
                continue
            yield from diff(a[k], b[k], tol, ignore, f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path}: {len(a)} items != {len(b)} items"
            return
        for i, (x, y) in enumerate(zip(a, b)):
            yield from diff(x, y, tol, ignore, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float))) or isinstance(a, bool) or isinstance(b, bool):
            yield f"{path}: {a!r} != {b!r}"
        elif not (a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol):
            yield f"{path}: {a!r} != {b!r}"
    elif a != b:
        yield f"{path}: {a!r} != {b!r}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench compare", description=__doc__.splitlines()[0])
    parser.add_argument("baseline")
    parser.add_argument("new")
    parser.add_argument("--tol", type=float, default=1e-6, help="absolute tolerance of floats (default 1e-6)")
    parser.add_argument("--ignore", action="append", default=[], help="a key to skip wherever it appears")
    args = parser.parse_args(argv)
    with open(args.baseline) as f, open(args.new) as g:
        a, b = json.load(f), json.load(g)
    found = list(diff(a, b, args.tol, TIMINGS | frozenset(args.ignore)))
    for line in found:
        print(line)
    print(f"{len(found)} difference(s)" if found else "same", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
