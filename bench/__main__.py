"""``python -m bench overhead|localization|agent [--json] [--quick] [...]``.

With ``--json`` exactly one JSON object is printed on stdout (progress goes to stderr with
``--verbose``); without it, a human-readable table.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any


def _progress(enabled: bool):
    if not enabled:
        return None

    def report(i: int, n: int, info: Any) -> None:
        print(f"[{i + 1}/{n}] {info}", file=sys.stderr, flush=True)

    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="name", required=True)

    ov = sub.add_parser("overhead", help="step-time overhead: plain vs per-layer vs per-token, interleaved")
    ov.add_argument("--rounds", type=int, default=None, help="measured rounds (default 40; 10 with --quick; steps per variant with --profile: 10, 3 with --quick)")
    ov.add_argument("--warmup", type=int, default=None, help="discarded warm-up rounds (default 3; 2 with --quick)")
    ov.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default 1; 0 = torch's default)")
    ov.add_argument("--profile", action="store_true",
                    help="instead of the A/B/C ratios: time gradloc's functions per step (where the overhead goes)")

    lo = sub.add_parser("localization", help="planted-culprit scenarios: gradloc vs GradLoc-style bisection")
    lo.add_argument("--seeds", type=int, default=None, help="seeds per scenario (default 5; 1 with --quick)")
    lo.add_argument("--train-steps", type=int, default=None, help="training steps before the scenarios")
    lo.add_argument("--kappa", type=float, default=None, help="bisection baseline's κ (default 4.0)")
    lo.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default 1; 0 = torch's default)")

    ag = sub.add_parser("agent", help="daemon ingest: 8 client processes, 256-layer records, one daemon core")
    ag.add_argument("--clients", type=int, default=None, help="client processes (default 8)")
    ag.add_argument("--layers", type=int, default=None, help="layers per record (default 256)")
    ag.add_argument("--records", type=int, default=None, help="records per client (default 4000)")
    ag.add_argument("--mode", choices=["client", "raw"], default=None,
                    help="client: the real AgentClient (default); raw: batches encoded up front with the real "
                         "codec and sent as fast as the daemon takes them (its capacity, not the clients')")

    for p in (ov, lo, ag):
        p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
        p.add_argument("--quick", action="store_true", help="a small, fast version (smoke tests)")
        p.add_argument("--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # gradloc's warnings would interleave with the table

    if args.name == "overhead":
        from dataclasses import replace

        from bench.overhead import (
            OverheadConfig,
            format_profile,
            format_table,
            run_overhead,
            run_profile,
        )

        cfg = OverheadConfig.quick() if args.quick else OverheadConfig()
        for field in ("rounds", "warmup", "threads"):
            if getattr(args, field) is not None:
                cfg = replace(cfg, **{field: getattr(args, field) or None})
        if args.profile:
            res = run_profile(cfg, steps=args.rounds or (3 if args.quick else 10))
            print(json.dumps(res) if args.json else format_profile(res))
            return 0
        res = run_overhead(cfg, _progress(args.verbose))
        print(json.dumps(res) if args.json else format_table(res))
        return 0

    if args.name == "agent":
        from dataclasses import replace

        from bench.agent import AgentBenchConfig, format_table, run_agent_bench

        cfg = AgentBenchConfig.quick() if args.quick else AgentBenchConfig()
        overrides = {"clients": args.clients, "layers": args.layers, "records_per_client": args.records,
                     "mode": args.mode}
        cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
        res = run_agent_bench(cfg, _progress(args.verbose))
        print(json.dumps(res) if args.json else format_table(res))
        return 0

    from dataclasses import replace

    from bench.localization import LocalizationConfig, format_table, run_localization

    cfg = LocalizationConfig.quick() if args.quick else LocalizationConfig()
    overrides = {"seeds": args.seeds, "train_steps": args.train_steps, "kappa": args.kappa}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.threads is not None:
        cfg = replace(cfg, threads=args.threads or None)
    res = run_localization(cfg, _progress(args.verbose))
    print(json.dumps(res) if args.json else format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
