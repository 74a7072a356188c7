"""``python -m bench <name> [...]``: every benchmark, one entry point (bench/README.md lists them all).

``overhead``, ``localization``, ``agent``, ``soak`` and ``healthy`` are parsed here (``overhead`` runs TinyGPT and an
HF Llama side by side, ``--model``; ``--memory``, ``--peers`` and ``--profile`` are its other modes); ``samples``,
``faults``, ``patterns``, ``precursors``, ``compare``, ``compile-guards`` and ``deepspeed-grads`` hand their
arguments to their own module's ``main`` (``--help`` there).

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


# benchmarks whose own module parses their arguments: name -> module
DELEGATED = {"samples": "bench.samples", "faults": "bench.faults", "compare": "bench.compare",
             "compile-guards": "bench.compile_guards", "deepspeed-grads": "bench.deepspeed_grads",
             "patterns": "bench.patterns", "precursors": "bench.precursors"}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in DELEGATED:
        import importlib

        return int(importlib.import_module(DELEGATED[args[0]]).main(args[1:]) or 0)
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0],
                                     epilog=f"also: {', '.join(DELEGATED)} (their own --help)")
    sub = parser.add_subparsers(dest="name", required=True)

    ov = sub.add_parser("overhead", help="step-time overhead: plain vs per-layer vs per-token, interleaved")
    ov.add_argument("--model", choices=["tinygpt", "llama", "qwen3moe", "all"], default=None,
                    help="TinyGPT, a random-initialized HF Llama, an HF Qwen3-MoE, or all three side by side "
                         "(default: TinyGPT and Llama; tinygpt with --peers and --profile)")
    ov.add_argument("--rounds", type=int, default=None,
                    help="measured rounds (default 40 for TinyGPT, 20 for Llama; 10 with --quick; steps per "
                         "variant with --profile: 10, 3 with --quick)")
    ov.add_argument("--warmup", type=int, default=None, help="discarded warm-up rounds (default 3; 2 with --quick)")
    ov.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default 1; 0 = torch's default)")
    ov.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda)")
    mode = ov.add_mutually_exclusive_group()
    mode.add_argument("--profile", action="store_true",
                      help="instead of the ratios: time gradloc's functions per step (where the overhead goes)")
    mode.add_argument("--memory", action="store_true",
                      help="instead of the ratios: peak memory per variant, one fresh process per run "
                           "(JSON under 'memory')")
    ov.add_argument("--rl", action="store_true",
                    help="add per_token_rl: the default monitor with per-token RL fields every micro-batch")
    mode.add_argument("--peers", action="store_true",
                      help="add Opacus ghost norms, BackPACK BatchL2Grad and wandb.watch to the TinyGPT run")
    mode.add_argument("--ddp", type=int, default=None, metavar="N",
                      help="run the variants as N DDP ranks of one gloo job (CPU; TinyGPT unless --model llama)")
    mode.add_argument("--parallel", choices=["fsdp-tp", "pp"], default=None,
                      help="run the variants as 4 ranks of a model-parallel gloo job: FSDP2 x tensor parallel (dp 2, "
                           "tp 2) or 2 pipeline stages x FSDP2 (dp 2), on the demo's ParallelGPT at TinyGPT's sizes")
    ov.add_argument("--no-clip", action="store_true",
                    help="--parallel: no gradient clipping (by default every variant clips to 1.0 with torchtitan's "
                         "clip_grad_norm_, whose norm all-reduce over the pipeline's stages a PP job runs anyway)")
    ov.add_argument("--precursors", action="store_true",
                    help="add per_layer/per_token_no_precursors: the defaults without the precursor statistics")
    ov.add_argument("--provenance", action="store_true",
                    help="add per_token_provenance: the default monitor with every sample's provenance and a loss mask")
    ov.add_argument("--on-spike", action="store_true",
                    help="add on_spike: token_stats='on_spike' (no module hook on healthy steps)")
    ov.add_argument("--compile", action="store_true",
                    help="run every variant's step through torch.compile(model) (inductor); adds on_spike")
    ov.add_argument("--repeats", type=int, default=None,
                    help="--memory: processes per variant and allocator setting (default 2; 1 with --quick)")

    lo = sub.add_parser("localization", help="planted-culprit scenarios: gradloc vs GradLoc-style bisection")
    lo.add_argument("--seeds", type=int, default=None, help="seeds per scenario (default 5; 1 with --quick)")
    lo.add_argument("--train-steps", type=int, default=None, help="training steps before the scenarios")
    lo.add_argument("--kappa", type=float, default=None, help="bisection baseline's κ (default 4.0)")
    lo.add_argument("--rl", action="store_true",
                    help="the RL scenario set instead: mismatch, low-probability large-advantage, two samples, packed")
    lo.add_argument("--faults", action="store_true",
                    help="the real-fault set instead (bench/faults.py): natural-text model, 8 data faults, >= 5 seeds")
    lo.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default 1; 0 = torch's default)")

    ag = sub.add_parser("agent", help="daemon ingest: 8 client processes, 256-layer records, one daemon core")
    ag.add_argument("--clients", type=int, default=None, help="client processes (default 8)")
    ag.add_argument("--layers", type=int, default=None, help="layers per record (default 256)")
    ag.add_argument("--records", type=int, default=None, help="records per client (default 4000)")
    ag.add_argument("--mode", choices=["client", "raw"], default=None,
                    help="client: the real AgentClient (default); raw: batches encoded up front with the real "
                         "codec and sent as fast as the daemon takes them (its capacity, not the clients')")

    so = sub.add_parser("soak", help="daemon soak: jobs starting and ending at the target rate; RSS, drops, "
                                     "series and correlator state over time")
    so.add_argument("--minutes", type=float, default=None, help="load duration (default 10; 1/3 with --quick)")
    so.add_argument("--rate", type=float, default=None, help="step records per second, all clients (default 5000)")
    so.add_argument("--encode", choices=["replay", "client"], default=None,
                    help="replay (default): each rank's record encoded once by the real codec, then restamped "
                         "(step, time) in the real AgentClient; client: every record encoded in the client "
                         "(~1,500/s on one core here)")

    he = sub.add_parser("healthy", help="false incidents per 1,000 healthy steps of HF models pre-trained on natural "
                                        "text, and recall on injected faults, per sensitivity setting")
    he.add_argument("--families", default=None, help="comma-separated model families of bench/natural.py "
                                                     "(default qwen2,gptneox)")
    he.add_argument("--seeds", type=int, default=None, help="seeds per family (default 3)")
    he.add_argument("--steps", type=int, default=None, help="steps per healthy run (default 2000)")
    he.add_argument("--fault-steps", type=int, default=None, help="steps per fault run (default 2000; 0: none)")
    he.add_argument("--traces", default=None, metavar="DIR", help="pickle each run's step records into DIR")
    he.add_argument("--from-traces", action="store_true", help="replay the runs saved in --traces DIR, no training")
    he.add_argument("--reuse-traces", action="store_true",
                    help="with --traces: a run whose trace is already in DIR is loaded, not trained again (more seeds "
                         "or families added to a measured set; the replay check holds each trace either way)")
    he.add_argument("--ddp", type=int, default=None, metavar="N",
                    help="each healthy run as an N-rank DDP job (its defaults), the drift detector judging the job's "
                         "values; no fault runs, no replay (bench/healthy_ddp.py)")
    he.add_argument("--drift", nargs="+", default=None, metavar="KEY=VALUE",
                    help="also replay the drift detector under these settings (gradloc.config.DriftConfig fields) over "
                         "the healthy runs' step records, or each DDP job's (bench/drift_rates.replay)")
    he.add_argument("--other-detector", action="store_true",
                    help="with --from-traces: the traces were recorded under another detector version, so the check "
                         "that a replay with the live config opens the live incidents is skipped (reported as null)")

    for p in (ov, lo, ag, so, he):
        p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
        p.add_argument("--quick", action="store_true", help="a small, fast version (smoke tests)")
        p.add_argument("--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(args)
    logging.basicConfig(level=logging.ERROR)  # gradloc's warnings would interleave with the table

    if args.name == "overhead":
        return _overhead(ov, args)

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

    if args.name == "healthy":
        from dataclasses import replace

        from bench.healthy import HealthyConfig, format_table, run_healthy

        hc = HealthyConfig.quick() if args.quick else HealthyConfig()
        overrides = {"seeds": args.seeds, "steps": args.steps, "fault_steps": args.fault_steps,
                     "families": tuple(args.families.split(",")) if args.families else None}
        hc = replace(hc, **{k: v for k, v in overrides.items() if v is not None})
        if args.from_traces and not args.traces:
            parser.error("--from-traces needs --traces DIR")
        if args.reuse_traces and not args.traces:
            parser.error("--reuse-traces needs --traces DIR")
        if args.other_detector and not args.from_traces:
            parser.error("--other-detector needs --from-traces")
        from bench.natural import FAMILIES

        if not set(hc.families) <= set(FAMILIES):
            parser.error(f"--families: each of {FAMILIES}, got {args.families!r}")
        drift = None
        if args.drift is not None:
            from bench.precursors import drift_config

            try:
                drift = drift_config(args.drift)
            except (ValueError, KeyError) as e:  # a bad setting (ConfigError is a ValueError)
                parser.error(str(e))
        if args.ddp is not None:
            from bench.healthy_ddp import format_ddp, run_healthy_ddp

            if args.ddp < 2 or args.traces:
                parser.error("--ddp takes N >= 2 ranks, and no --traces")
            res = run_healthy_ddp(replace(hc.run, steps=hc.steps), hc.families, hc.seeds, args.ddp, drift=drift)
            print(json.dumps(res) if args.json else format_ddp(res))
            return 0
        res = run_healthy(hc, _progress(args.verbose), traces=args.traces, from_traces=args.from_traces,
                          check_live=not args.other_detector, reuse=args.reuse_traces, drift=drift)
        print(json.dumps(res) if args.json else format_table(res))
        return 0

    if args.name == "soak":
        from dataclasses import replace

        from bench.soak import SoakConfig, format_table, run_soak

        soak = SoakConfig.quick() if args.quick else SoakConfig()
        overrides = {"minutes": args.minutes, "rate": args.rate, "encode": args.encode}
        try:
            soak = replace(soak, **{k: v for k, v in overrides.items() if v is not None})
        except ValueError as e:
            parser.error(str(e))
        res = run_soak(soak, _progress(args.verbose))
        print(json.dumps(res) if args.json else format_table(res))
        return 0

    from dataclasses import replace

    if args.faults:
        from bench.faults import format_table as faults_table
        from bench.faults import from_args

        res = from_args(args)
        print(json.dumps(res) if args.json else faults_table(res))
        return 0

    if args.rl:
        from bench.localization_rl import RLBenchConfig, run_rl_localization
        from bench.localization_rl import format_table as rl_table

        rl_cfg = RLBenchConfig.quick() if args.quick else RLBenchConfig()
        if args.seeds is not None:
            rl_cfg = replace(rl_cfg, seeds=args.seeds)
        res = run_rl_localization(rl_cfg, _progress(args.verbose))
        print(json.dumps(res) if args.json else rl_table(res))
        return 0

    from bench.localization import LocalizationConfig, run_localization
    from bench.localization_summary import format_table

    cfg = LocalizationConfig.quick() if args.quick else LocalizationConfig()
    overrides = {"seeds": args.seeds, "train_steps": args.train_steps, "kappa": args.kappa}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.threads is not None:
        cfg = replace(cfg, threads=args.threads or None)
    res = run_localization(cfg, _progress(args.verbose))
    print(json.dumps(res) if args.json else format_table(res))
    return 0


def _overhead(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from bench.models import ALL_MODELS, MODELS

    if args.repeats is not None and not args.memory:
        parser.error("--repeats is for --memory")
    single = args.peers or args.profile
    model = args.model or ("tinygpt" if single else "default")
    if single and model != "tinygpt" and not (args.profile and model == "llama"):
        parser.error(f"--{'peers' if args.peers else 'profile'} runs on one model"
                     f"{' (TinyGPT)' if args.peers else ''}: not --model {model}")
    models = MODELS if model == "default" else ALL_MODELS if model == "all" else (model,)
    threads = None if args.threads == 0 else (args.threads or 1)
    if args.memory:
        from bench.memory import MemoryConfig, format_memory, run_memory

        repeats = args.repeats or (1 if args.quick else 2)
        try:
            mem = MemoryConfig(models=models, repeats=repeats, steps=3 if args.quick else 5, quick=args.quick,
                               threads=threads, device=args.device)
        except ValueError as e:
            parser.error(str(e))
        res = run_memory(mem, _progress(args.verbose))
        print(json.dumps(res) if args.json else format_memory(res))
        return 0

    from bench.overhead import OverheadConfig, format_table, run_overhead

    if args.ddp is not None:
        if args.ddp < 2 or model == "all" or args.device != "cpu" or args.rl or args.compile:
            parser.error("--ddp N needs N >= 2, one model (TinyGPT by default), the CPU, no --rl and no --compile")
        models = ("tinygpt",) if model == "default" else (model,)
    if args.no_clip and args.parallel is None:
        parser.error("--no-clip goes with --parallel")
    if args.parallel is not None:
        if model not in ("default", "tinygpt") or args.device != "cpu" or args.rl or args.compile or args.on_spike:
            parser.error("--parallel runs ParallelGPT at TinyGPT's sizes on the CPU: no --model, --rl, --compile, "
                         "--on-spike")
        models = ("tinygpt",)
    kw = {"models": models, "threads": threads, "peers": args.peers, "rl": args.rl, "device": args.device,
          "on_spike": args.on_spike, "compile": args.compile, "provenance": args.provenance,
          "precursors": args.precursors}
    kw.update({k: getattr(args, k) for k in ("rounds", "warmup") if getattr(args, k) is not None})
    try:
        cfg = OverheadConfig.quick_config(**kw) if args.quick else OverheadConfig(**kw)
    except ValueError as e:
        parser.error(str(e))
    if args.profile:
        from bench.profile import format_profile, run_profile

        res = run_profile(cfg, steps=args.rounds or (3 if args.quick else 10))
        print(json.dumps(res) if args.json else format_profile(res))
        return 0
    if args.ddp is not None:
        from bench.ddp import format_ddp, run_ddp_overhead

        res = run_ddp_overhead(cfg, args.ddp)
        print(json.dumps(res) if args.json else format_ddp(res))
        return 0
    if args.parallel is not None:
        from bench.parallel import CLIP, format_parallel, run_parallel_overhead

        res = run_parallel_overhead(cfg, args.parallel, clip=None if args.no_clip else CLIP)
        print(json.dumps(res) if args.json else format_parallel(res))
        return 0
    res = run_overhead(cfg, _progress(args.verbose))
    print(json.dumps(res) if args.json else format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
