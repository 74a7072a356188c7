"""Step-time overhead of gradloc, interleaved A/B/C in one process, on TinyGPT and on an HF Llama.

Per model, copies of one seeded model (same initial weights, same data every round, same AdamW):

- ``plain``: no monitor;
- ``per_layer``: ``WatchConfig(token_stats=False)`` with the optimizer passed (per-layer norms,
  update-to-weight ratios through optimizer hooks);
- ``per_token``: the default ``WatchConfig()`` (per-layer + per-token hooks + update ratios);
- with ``--peers`` (TinyGPT only): Opacus ghost norms, BackPACK ``BatchL2Grad``, ``wandb.watch``
  (``bench/peers.py``).

Each round runs one full optimizer step of every variant (``bench/variants.py``) in a rotating
order, so slow drifts of the machine (other processes, thermal, allocator state) hit all alike.
The first ``warmup`` rounds are discarded; the ratios are of median step times.

No probe closure is passed to ``end_step``: this measures the steady-state cost of monitoring a
healthy step. (A spike's localization costs at most ``max_probes`` extra forward+backward passes of
one micro-batch each, on that step only; see the localization benchmark.)
"""
from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from bench import torch_threads
from bench.models import ALL_MODELS, MODELS, ModelConfig, build_model, model_config, param_bytes
from bench.variants import GRADLOC_VARIANTS, Variant, computes, make_variant

VARIANTS = ("plain", "per_layer", "per_token")
PEER_VARIANTS = ("opacus_ghost", "backpack_l2", "wandb_watch")


@dataclass(frozen=True)
class OverheadConfig:
    models: tuple[str, ...] = MODELS
    rounds: int | None = None  # None: each model's default (40 for TinyGPT, 20 for Llama; 10 with quick)
    warmup: int = 3
    lr: float = 3e-4
    seed: int = 0
    # one intra-op thread: on a shared 2-core machine torch's default of 2 OpenMP threads made step
    # times swing between 0.4 s and 8 s (spinning barriers under preemption); --threads to change
    threads: int | None = 1
    quick: bool = False  # the small models of bench.models.QUICK
    peers: bool = False  # add the peer tools' variants (TinyGPT only)
    rl: bool = False  # add per_token_rl: the default monitor with per-token RL fields
    provenance: bool = False  # add per_token_provenance: the default monitor with every sample's provenance
    precursors: bool = False  # add per_layer/per_token_no_precursors: the defaults without the precursor statistics
    on_spike: bool = False  # add on_spike: token_stats="on_spike" (no module hook on healthy steps)
    compile: bool = False  # every variant's step calls torch.compile(model) (inductor); adds on_spike
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.models or any(m not in ALL_MODELS for m in self.models):
            raise ValueError(f"models must be a non-empty subset of {ALL_MODELS}, got {self.models}")
        if self.compile and (self.peers or self.rl):
            raise ValueError("--compile times plain, per_layer, per_token and on_spike (no peers, no --rl)")
        if self.peers and self.models != ("tinygpt",):
            raise ValueError("the peer tools run on TinyGPT only (Opacus' ghost clipping refuses tied embeddings)")
        if (self.rounds is not None and self.rounds < 1) or self.warmup < 0:
            raise ValueError(f"need rounds >= 1 and warmup >= 0, got {self.rounds}, {self.warmup}")

    @staticmethod
    def quick_config(**overrides: Any) -> OverheadConfig:
        return OverheadConfig(**{"quick": True, "warmup": 2, **overrides})

    def model(self, kind: str) -> ModelConfig:
        return model_config(kind, self.quick)

    def rounds_for(self, kind: str) -> int:
        return self.rounds if self.rounds is not None else self.model(kind).rounds

    @property
    def variants(self) -> tuple[str, ...]:
        return (VARIANTS + (("on_spike",) if self.on_spike or self.compile else ())
                + (("per_token_rl",) if self.rl else ()) + (("per_token_provenance",) if self.provenance else ())
                + (("per_layer_no_precursors", "per_token_no_precursors") if self.precursors else ())
                + (PEER_VARIANTS if self.peers else ()))


def _ms(xs: list[float]) -> float:
    return round(1000.0 * statistics.median(xs), 3) if xs else float("nan")


def make_batches(mcfg: ModelConfig, gen: torch.Generator, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One optimizer step's micro-batches of uniformly random ids: (inputs, shifted labels), (B, T) each."""
    tokens = torch.randint(mcfg.vocab, (mcfg.micro_batches, mcfg.batch, mcfg.seq + 1), generator=gen).to(device)
    return [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(mcfg.micro_batches)]  # (B, T+1) -> 2 × (B, T)


def run_overhead(cfg: OverheadConfig, progress: Any = None) -> dict[str, Any]:
    load_start, start = os.getloadavg()[0], time.perf_counter()
    with torch_threads(cfg.threads):
        models = {kind: _run_model(kind, cfg, progress) for kind in cfg.models}
        threads = torch.get_num_threads()
    out: dict[str, Any] = {"models": models}
    if cfg.peers:
        res = models["tinygpt"]
        out["peers"] = {name: {"ratio": res[f"{name}_ratio"], "step_ms": res[f"{name}_step_ms"],
                               "computes": res["computes"][name], "identical_to_plain": res["identical_to_plain"][name]}
                        for name in PEER_VARIANTS}
    out.update({"torch_threads": threads, "torch_version": torch.__version__, "device": cfg.device,
                "compiled": cfg.compile,
                "nproc": os.cpu_count(), "wall_s": round(time.perf_counter() - start, 1),
                "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)]})  # at start, at end
    return out


def _run_model(kind: str, cfg: OverheadConfig, progress: Any) -> dict[str, Any]:
    mcfg, rounds = cfg.model(kind), cfg.rounds_for(kind)
    base = build_model(mcfg, cfg.seed).to(cfg.device)
    variants: list[Variant] = []
    load_start, start = os.getloadavg()[0], time.perf_counter()
    try:
        for name in cfg.variants:
            variants.append(make_variant(name, copy.deepcopy(base), cfg.lr, cfg.device, cfg.compile))
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        for r in range(cfg.warmup + rounds):
            batches = make_batches(mcfg, gen, cfg.device)
            k = r % len(variants)
            for v in variants[k:] + variants[:k]:  # rotating order
                v.step(batches, mcfg.tokens_per_step, record=r >= cfg.warmup)
            if progress is not None:
                progress(r, cfg.warmup + rounds, {"model": kind, **{v.name: v.step_s[-1] if v.step_s else None
                                                                    for v in variants}})
    finally:
        for v in variants:
            v.close()
    res = _summarize(variants, mcfg, base, rounds, cfg.warmup)
    res["wall_s"] = round(time.perf_counter() - start, 1)
    res["loadavg_1m"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    return res


def _summarize(variants: list[Variant], mcfg: ModelConfig, base: torch.nn.Module, rounds: int,
               warmup: int) -> dict[str, Any]:
    by = {v.name: v for v in variants}
    plain, others = by["plain"], [v for v in variants if v.name != "plain"]
    med = {v.name: statistics.median(v.step_s) for v in variants}
    cpu = {v.name: statistics.median(v.cpu_s) for v in variants}
    res: dict[str, Any] = {**mcfg.describe(), "params": sum(p.numel() for p in base.parameters()),
                           "param_mb": round(param_bytes(base) / 2**20, 2), "rounds": rounds,
                           "warmup_rounds": warmup, "tokens_per_step": mcfg.tokens_per_step}
    for v in others:
        res[f"{v.name}_ratio"] = round(med[v.name] / med["plain"], 4)
    for v in variants:
        res[f"{v.name}_step_ms"] = _ms(v.step_s)
    for v in others:
        # per-round paired ratios: a robustness check on the ratio of medians
        res[f"paired_{v.name}_ratio"] = round(statistics.median(a / b for a, b in zip(v.step_s, plain.step_s)), 4)
        # process CPU time: robust to preemption with one thread; with several OpenMP threads it also
        # counts their spin-waiting; it does not count other processes (wandb's service)
        res[f"cpu_{v.name}_ratio"] = round(cpu[v.name] / cpu["plain"], 4)
    res["cpu_step_ms"] = {v.name: _ms(v.cpu_s) for v in variants}
    res["phases_ms"] = {v.name: {k: _ms(xs) for k, xs in v.phase_s.items()} for v in variants}
    # identical init + identical data: monitoring must not change the update (gradloc's contract);
    # for the peers this is a fact reported, not a requirement
    same = {v.name: all(torch.equal(a, b) for a, b in zip(plain.params(), v.params())) for v in others}
    res["identical_to_plain"] = same
    res["updates_identical"] = all(same[n] for n in same if n in GRADLOC_VARIANTS)
    res["spikes_flagged"] = {v.name: v.extra["spikes_flagged"] for v in others if "spikes_flagged" in v.extra}
    res["computes"] = {v.name: computes(v.name) for v in variants}
    res["extra"] = {v.name: {k: x for k, x in v.extra.items() if k != "spikes_flagged"} for v in others
                    if any(k != "spikes_flagged" for k in v.extra)}
    return res


def format_table(res: dict[str, Any]) -> str:
    lines: list[str] = []
    for kind, m in res["models"].items():
        names = list(m["phases_ms"])
        rows = [("variant", "step ms", "ratio", "paired", "CPU-time", "fwd+bwd ms", "end_step ms", "opt.step ms")]
        for name in names:
            ph = m["phases_ms"][name]
            ratios = ("1.000",) * 3 if name == "plain" else tuple(
                f"{m[key]:.3f}" for key in (f"{name}_ratio", f"paired_{name}_ratio", f"cpu_{name}_ratio"))
            rows.append((name, f"{m[f'{name}_step_ms']:.1f}", *ratios, f"{ph['fwd_bwd']:.1f}",
                         f"{ph['end_step']:.2f}", f"{ph['opt_step']:.2f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append(f"{kind}: d_model {m['d_model']}, {m['n_layers']} layers, {m['params']:,} params, "
                     f"{m['tokens_per_step']} tokens/step, {m['rounds']} rounds (+{m['warmup_rounds']} warm-up), "
                     f"{m['wall_s']} s, load average {m['loadavg_1m'][0]} -> {m['loadavg_1m'][1]}")
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append(f"updates identical to plain: {m['identical_to_plain']}")
        if res.get("peers"):
            lines += [f"  {name}: {m['computes'][name]}" for name in names]
        lines.append("")
    lines.append(f"torch {res['torch_version']} on {res['torch_threads']} threads ({res['device']}), "
                 f"{res['wall_s']} s, load average {res['loadavg_1m'][0]} -> {res['loadavg_1m'][1]} "
                 f"on {res['nproc']} CPUs")
    return "\n".join(lines)
