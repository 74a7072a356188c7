"""Per-sample outlier findings on a model pre-trained on natural text: ``python -m bench samples [--json] [--quick]``.

``--text``: false outliers per kind of real text (prose, legal, code, markup) on the issue's byte-level
GPT-2 loop, and the flag rate of garbage and shifted labels (``bench/samples_text.py``).

A tiny HF model (``bench/natural.py``: Qwen2 by default; the standard library's docstrings and the
license texts, byte-level BPE) trains from step 0 with gradloc attached at its default
``SampleConfig``. After ``burn_in`` steps, each of the next ``eval_steps`` steps turns one random
sample into a fault with probability ``fault_rate`` (the kinds take turns; the faulty sample is
trained on, as in a real run). Per kind, a fault counts as **detected** when the step's
``StepRecord.samples`` names that (micro-batch, sample) as a ``surprise`` outlier; every other
flagged sample of the evaluation steps is a **false outlier**, counted per 1,000 judged healthy
samples. Outliers during the burn-in are reported too (the model is still learning the text).

Faults (what a data pipeline gets wrong):

- ``random_ids``: uniformly random ids (binary garbage);
- ``shifted_labels_5``: the labels are the sample's own tokens 5 positions later (misaligned labels);
- ``shifted_labels_1``: the labels are the inputs (an off-by-one label shift);
- ``foreign_script``: a whole sample of random words in another script (Cyrillic, Greek, CJK, …);
- ``foreign_span``: 32 tokens of such text in the middle of a natural sample;
- ``truncated``: the document stops half-way and the rest is end-of-text padding the loss still counts;
- ``duplicated``: the sample's second half repeats its first half (a duplicated document).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench import torch_threads
from bench.natural import Run, RunConfig, StepBatch
from bench.natural_faults import foreign_text, inject
from gradloc.config import SampleConfig

FAULTS = ("random_ids", "shifted_labels_5", "shifted_labels_1", "foreign_script", "foreign_span", "truncated",
          "duplicated")


@dataclass(frozen=True)
class SamplesConfig:
    burn_in: int = 400
    eval_steps: int = 900
    fault_rate: float = 0.5
    faults: tuple[str, ...] = FAULTS
    samples: SampleConfig = field(default_factory=SampleConfig)
    run: RunConfig = field(default_factory=lambda: RunConfig(seq=128, batch=8, micro_batches=2, d_model=128,
                                                             n_layers=2, steps=1300))
    threads: int | None = 1

    @staticmethod
    def quick() -> "SamplesConfig":
        return SamplesConfig(burn_in=250, eval_steps=150, run=RunConfig(seq=128, batch=8, micro_batches=2,
                                                                         d_model=128, n_layers=2, steps=400))


def make_fault(kind: str, batch: StepBatch, gen: torch.Generator, run: Run, step: int) -> tuple[int, int]:
    """Turn one random sample of ``batch`` into a ``kind`` fault (in place); its (micro-batch, sample)."""
    if kind in ("random_ids", "foreign_script"):
        f = inject(kind, batch, gen, run.model, run.corpus, step)
        return f.micro_batch, f.sample
    if kind == "shifted_labels_1":
        f = inject("shifted_labels", batch, gen, run.model, run.corpus, step)
        return f.micro_batch, f.sample
    M, B, T = batch.weights.shape
    mb, b = int(torch.randint(0, M, (1,), generator=gen)), int(torch.randint(0, B, (1,), generator=gen))
    w = batch.windows[mb]  # (B, T + 1)
    if kind == "shifted_labels_5":  # label at t: the token 5 positions after the right one (wrapping)
        for t in range(T):
            batch.label_override[(mb, b, t)] = int(w[b, (t + 6) % (T + 1)])
    elif kind == "foreign_span":
        _, text = foreign_text(gen, 30)
        ids = run.corpus.encode(text)
        while len(ids) < 32:
            ids = ids + ids
        start = int(torch.randint(16, T - 48, (1,), generator=gen))
        w[b, start:start + 32] = torch.tensor(ids[:32])
    elif kind == "truncated":
        w[b, (T + 1) // 2:] = run.corpus.eos
    elif kind == "duplicated":
        h = (T + 1) // 2
        w[b, h:2 * h] = w[b, :h].clone()
    else:
        raise ValueError(f"unknown fault {kind!r}")
    return mb, b


def run_samples(cfg: SamplesConfig, progress: Any = None) -> dict[str, Any]:
    torch_threads(cfg.threads)
    run = Run(cfg.run, samples=cfg.samples)
    gen = torch.Generator().manual_seed(7)
    injected, detected = Counter(), Counter()
    zs: dict[str, list[float]] = {k: [] for k in cfg.faults}
    healthy = false = burn_flagged = burn_judged = 0
    z_counts = [0] * 14  # every judged sample of the evaluation steps, per SAMPLE_Z_BUCKETS (faults included)
    false_examples: list[dict[str, Any]] = []
    t0 = time.time()
    for step in range(cfg.burn_in + cfg.eval_steps):
        batch = run.batch(step)
        fault, kind = None, None
        if step >= cfg.burn_in and float(torch.rand((), generator=gen)) < cfg.fault_rate:
            kind = cfg.faults[sum(injected.values()) % len(cfg.faults)]
            fault = make_fault(kind, batch, gen, run, step)
            injected[kind] += 1
        report = run.step(batch)
        s = report.record.samples
        if s is None:
            continue
        flagged = {(o.micro_batch, o.sample): o for o in s.outliers if o.kind == "surprise"}
        if step < cfg.burn_in:
            burn_flagged += s.flagged
            burn_judged += s.judged
            continue
        z_counts = [a + b for a, b in zip(z_counts, s.z_counts)] if s.z_counts else z_counts
        if fault is not None and fault in flagged:
            detected[kind] += 1
            zs[kind].append(round(flagged[fault].z, 1))
        wrong = [o for key, o in flagged.items() if key != fault]
        false += len(wrong) + max(0, s.flagged - len(s.outliers))
        healthy += s.judged - (1 if fault is not None else 0)
        false_examples += [dict(step=o.step, z=round(o.z, 1), score=round(o.score, 2), baseline=round(o.baseline, 2),
                                span=[o.start, o.end]) for o in wrong][: max(0, 5 - len(false_examples))]
        if progress and step % 50 == 0:
            progress(step, cfg.burn_in + cfg.eval_steps, f"false {false}/{healthy}, detected {dict(detected)}")
    run.close()
    per_kind = {k: {"injected": injected[k], "detected": detected[k],
                    "rate": round(detected[k] / injected[k], 3) if injected[k] else None,
                    "z_median": sorted(zs[k])[len(zs[k]) // 2] if zs[k] else None} for k in cfg.faults}
    return {"config": asdict(cfg), "seconds": round(time.time() - t0, 1), "params": run.params,
            "corpus": run.corpus.info(), "faults": per_kind, "healthy_samples": healthy, "false_outliers": false,
            "false_per_1000": round(1000 * false / healthy, 3) if healthy else None,
            "false_examples": false_examples, "z_counts": z_counts, "burn_in": {"judged": burn_judged, "flagged": burn_flagged}}


def run_overhead_ab(models: tuple[str, ...] = ("tinygpt", "llama"), rounds: int | None = None, quick: bool = False,
                    threads: int | None = 1, progress: Any = None) -> dict[str, Any]:
    """Step time of ``plain``, the default monitor without per-sample findings (``samples_off``) and the
    default monitor (``per_token``), interleaved in one process like ``python -m bench overhead``."""
    import copy
    import statistics

    from bench.models import build_model, model_config
    from bench.overhead import make_batches
    from bench.variants import GRADLOC_VARIANTS, make_variant

    GRADLOC_VARIANTS["samples_off"] = {"samples": SampleConfig(enabled=False)}
    out: dict[str, Any] = {}
    torch_threads(threads)
    for kind in models:
        mcfg = model_config(kind, quick)
        n = rounds if rounds is not None else mcfg.rounds
        base = build_model(mcfg, 0)
        variants = [make_variant(name, copy.deepcopy(base), 3e-4) for name in ("plain", "samples_off", "per_token")]
        gen = torch.Generator().manual_seed(1)
        try:
            for r in range(3 + n):
                batches = make_batches(mcfg, gen, "cpu")
                k = r % len(variants)
                for v in variants[k:] + variants[:k]:  # rotating order
                    v.step(batches, mcfg.tokens_per_step, record=r >= 3)
                if progress:
                    progress(r, 3 + n, kind)
        finally:
            for v in variants:
                v.close()
        med = {v.name: statistics.median(v.step_s) for v in variants}
        by = {v.name: v for v in variants}
        paired = statistics.median(a / b for a, b in zip(by["per_token"].step_s, by["samples_off"].step_s))
        out[kind] = {"rounds": n, "tokens_per_step": mcfg.tokens_per_step,
                     **{f"{k}_step_ms": round(1000 * x, 3) for k, x in med.items()},
                     "samples_off_ratio": round(med["samples_off"] / med["plain"], 4),
                     "per_token_ratio": round(med["per_token"] / med["plain"], 4),
                     "with_over_without": round(med["per_token"] / med["samples_off"], 4),
                     "paired_with_over_without": round(paired, 4),
                     "cpu_with_over_without": round(statistics.median(by["per_token"].cpu_s)
                                                    / statistics.median(by["samples_off"].cpu_s), 4),
                     "cpu_per_token_ratio": round(statistics.median(by["per_token"].cpu_s)
                                                  / statistics.median(by["plain"].cpu_s), 4),
                     "cpu_samples_off_ratio": round(statistics.median(by["samples_off"].cpu_s)
                                                    / statistics.median(by["plain"].cpu_s), 4),
                     "loadavg_1m": round(os.getloadavg()[0], 2),
                     "end_step_ms": {v.name: round(1000 * statistics.median(v.phase_s["end_step"]), 3)
                                     for v in variants if v.phase_s["end_step"]}}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench samples", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--family", default=None, help="model family of bench/natural.py (default qwen2)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--fault-rate", type=float, default=None, help="share of evaluation steps with a fault (0.5)")
    parser.add_argument("--eval-steps", type=int, default=None, help="evaluation steps after the burn-in (900)")
    parser.add_argument("--verbose", action="store_true", help="progress on stderr")
    parser.add_argument("--text", action="store_true",
                        help="instead: false outliers per kind of real text, byte-level GPT-2 (bench/samples_text.py)")
    parser.add_argument("--overhead", action="store_true",
                        help="instead: step time with and without per-sample findings (TinyGPT, HF Llama), interleaved")
    args = parser.parse_args(argv)
    if args.text:
        from bench.samples_text import TextConfig, report, run_text

        progress = (lambda i, n, info: print(f"[{i}/{n}] {info}", file=sys.stderr, flush=True)) if args.verbose else None
        cfg_text = TextConfig.quick() if args.quick else TextConfig()
        if args.seed is not None:  # another model initialisation and other text windows (a held-out run)
            from dataclasses import replace

            cfg_text = replace(cfg_text, seed=args.seed)
        out = run_text(cfg_text, progress)
        print(json.dumps(out) if args.json else report(out))
        return 0
    if args.overhead:
        progress = (lambda i, n, info: print(f"[{i}/{n}] {info}", file=sys.stderr, flush=True)) if args.verbose else None
        print(json.dumps(run_overhead_ab(quick=args.quick, progress=progress), indent=None if args.json else 1))
        return 0
    cfg = SamplesConfig.quick() if args.quick else SamplesConfig()
    if args.family or args.seed is not None:
        from dataclasses import replace

        cfg = replace(cfg, run=replace(cfg.run, family=args.family or cfg.run.family,
                                       seed=cfg.run.seed if args.seed is None else args.seed))
    if args.fault_rate is not None or args.eval_steps is not None:
        from dataclasses import replace

        ev = cfg.eval_steps if args.eval_steps is None else args.eval_steps
        cfg = replace(cfg, fault_rate=cfg.fault_rate if args.fault_rate is None else args.fault_rate, eval_steps=ev,
                      run=replace(cfg.run, steps=cfg.burn_in + ev))
    progress = (lambda i, n, info: print(f"[{i}/{n}] {info}", file=sys.stderr, flush=True)) if args.verbose else None
    out = run_samples(cfg, progress)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{cfg.run.family}, {out['params']:,} parameters, {cfg.burn_in} burn-in + {cfg.eval_steps} steps "
          f"({out['seconds']} s)")
    for k, v in out["faults"].items():
        print(f"  {k:18s} detected {v['detected']:3d}/{v['injected']:3d}  rate {v['rate']}  median z {v['z_median']}")
    print(f"  false outliers: {out['false_outliers']} in {out['healthy_samples']} healthy samples "
          f"({out['false_per_1000']} per 1,000); burn-in: {out['burn_in']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
