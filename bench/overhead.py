"""Step-time overhead of gradloc on a GPT-like model, interleaved A/B/C in one process.

Three copies of one TinyGPT (same initial weights, same data every round, same AdamW settings):

- ``plain``: no monitor;
- ``per_layer``: ``WatchConfig(token_stats=False)`` with the optimizer passed (per-layer norms,
  update-to-weight ratios through optimizer hooks);
- ``per_token``: the default ``WatchConfig()`` (per-layer + per-token hooks + update ratios).

Each round runs one full optimizer step of every variant (forward, backward inside
``mon.micro_batch``, ``mon.end_step(loss)``, ``optimizer.step()``, ``zero_grad()``) in a rotating
order, so slow drifts of the machine (other processes, thermal, allocator state) hit all three
alike. The first ``warmup`` rounds are discarded; the ratios are of median step times.

No probe closure is passed to ``end_step``: this measures the steady-state cost of monitoring a
healthy step. (A spike's localization costs at most ``max_probes`` extra forward+backward passes of
one micro-batch each, on that step only; see the localization benchmark.)
"""
from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Self

import torch

import gradloc
from bench import torch_threads
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses

VARIANTS = ("plain", "per_layer", "per_token")


@dataclass(frozen=True)
class OverheadConfig:
    rounds: int = 40
    warmup: int = 3
    micro_batches: int = 2
    batch: int = 4
    seq: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    vocab: int = 4096
    lr: float = 3e-4
    seed: int = 0
    # one intra-op thread: on a shared 2-core machine torch's default of 2 OpenMP threads made step
    # times swing between 0.4 s and 8 s (spinning barriers under preemption); --threads to change
    threads: int | None = 1

    @staticmethod
    def quick() -> OverheadConfig:
        return OverheadConfig(rounds=10, warmup=2, micro_batches=1, batch=2, seq=64, d_model=64,
                              n_layers=2, n_heads=4, vocab=512)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.batch * self.seq


class _Variant:
    def __init__(self, name: str, model: TinyGPT, cfg: OverheadConfig) -> None:
        self.name, self.model = name, model
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        self.mon = None
        # The defaults users get, embedded agent included (its store in a throw-away file).
        self.store = store = os.path.join(tempfile.gettempdir(), f"gradloc-bench-{os.getpid()}-{name}.db")
        if name == "per_layer":
            self.mon = gradloc.watch(model, self.opt, config=gradloc.WatchConfig(job="bench", token_stats=False,
                                                                                 store_path=store))
        elif name == "per_token":
            self.mon = gradloc.watch(model, self.opt, config=gradloc.WatchConfig(job="bench", store_path=store))
        self.step_s: list[float] = []
        self.cpu_s: list[float] = []  # process CPU time of the step: insensitive to preemption
        self.phase_s: dict[str, list[float]] = {"fwd_bwd": [], "end_step": [], "opt_step": []}
        self.spikes = 0

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], n_tokens: int, record: bool) -> None:
        model, mon, opt = self.model, self.mon, self.opt
        c0 = time.process_time()
        t0 = time.perf_counter()
        total = torch.zeros(())
        for x, y in batches:
            if mon is None:
                loss = token_losses(model(x), y).sum() / n_tokens
                loss.backward()
            else:
                with mon.micro_batch(y):
                    loss = token_losses(model(x), y).sum() / n_tokens
                    loss.backward()
            total += loss.detach()
        t1 = time.perf_counter()
        if mon is not None:
            report = mon.end_step(total)
            self.spikes += int(report.spike.is_spike)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        c3 = time.process_time()
        if record:
            self.step_s.append(t3 - t0)
            self.cpu_s.append(c3 - c0)
            self.phase_s["fwd_bwd"].append(t1 - t0)
            self.phase_s["end_step"].append(t2 - t1)
            self.phase_s["opt_step"].append(t3 - t2)

    def close(self) -> None:
        if self.mon is not None:
            self.mon.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.store + suffix):
                os.remove(self.store + suffix)


def _ms(xs: list[float]) -> float:
    return round(1000.0 * statistics.median(xs), 3) if xs else float("nan")


def _base_model(cfg: OverheadConfig) -> TinyGPT:
    """The seeded model every variant starts from (each variant gets a deep copy)."""
    torch.manual_seed(cfg.seed)
    return TinyGPT(GPTConfig(vocab=cfg.vocab, seq=cfg.seq, d_model=cfg.d_model, n_layers=cfg.n_layers,
                             n_heads=cfg.n_heads))


def run_overhead(cfg: OverheadConfig, progress: Any = None) -> dict[str, Any]:
    with torch_threads(cfg.threads):
        return _run_overhead(cfg, progress)


def _run_overhead(cfg: OverheadConfig, progress: Any) -> dict[str, Any]:
    base = _base_model(cfg)
    variants = [_Variant(name, copy.deepcopy(base), cfg) for name in VARIANTS]
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    n_tokens = cfg.tokens_per_step
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        for r in range(cfg.warmup + cfg.rounds):
            tokens = torch.randint(cfg.vocab, (cfg.micro_batches, cfg.batch, cfg.seq + 1), generator=gen)
            batches = [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(cfg.micro_batches)]
            order = variants[r % 3:] + variants[:r % 3]  # rotating order
            for v in order:
                v.step(batches, n_tokens, record=r >= cfg.warmup)
            if progress is not None:
                progress(r, cfg.warmup + cfg.rounds, {v.name: v.step_s[-1] if v.step_s else None for v in variants})
    finally:
        for v in variants:
            v.close()
    elapsed = time.perf_counter() - start
    by = {v.name: v for v in variants}
    plain = statistics.median(by["plain"].step_s)
    # identical init + identical data: monitoring must not change the update (sanity check)
    same = all(torch.equal(a, b) for a, b in zip(by["plain"].model.parameters(), by["per_token"].model.parameters()))
    # per-round paired ratios: a robustness check on the ratio of medians
    paired = {name: statistics.median(a / b for a, b in zip(by[name].step_s, by["plain"].step_s))
              for name in ("per_layer", "per_token")}
    return {
        "per_layer_ratio": round(statistics.median(by["per_layer"].step_s) / plain, 4),
        "per_token_ratio": round(statistics.median(by["per_token"].step_s) / plain, 4),
        "plain_step_ms": _ms(by["plain"].step_s),
        "per_layer_step_ms": _ms(by["per_layer"].step_s),
        "per_token_step_ms": _ms(by["per_token"].step_s),
        "rounds": cfg.rounds,
        "warmup_rounds": cfg.warmup,
        "tokens_per_step": n_tokens,
        "micro_batches": cfg.micro_batches,
        "batch": cfg.batch,
        "seq": cfg.seq,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "vocab": cfg.vocab,
        "params": sum(p.numel() for p in base.parameters()),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "paired_per_layer_ratio": round(paired["per_layer"], 4),
        "paired_per_token_ratio": round(paired["per_token"], 4),
        # medians of process CPU time per step: robust to preemption by other processes with one
        # thread; with several OpenMP threads it also counts their spin-waiting
        "cpu_per_layer_ratio": round(statistics.median(by["per_layer"].cpu_s) / statistics.median(by["plain"].cpu_s), 4),
        "cpu_per_token_ratio": round(statistics.median(by["per_token"].cpu_s) / statistics.median(by["plain"].cpu_s), 4),
        "cpu_step_ms": {v.name: _ms(v.cpu_s) for v in variants},
        "phases_ms": {v.name: {k: _ms(xs) for k, xs in v.phase_s.items()} for v in variants},
        "spikes_flagged": {v.name: v.spikes for v in variants if v.mon is not None},
        "updates_identical": same,
        "wall_s": round(elapsed, 1),
        "nproc": os.cpu_count(),
        "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],  # at start, at end
    }


def format_table(res: dict[str, Any]) -> str:
    rows = [("variant", "step ms", "ratio", "fwd+bwd ms", "end_step ms", "opt.step ms")]
    for name in VARIANTS:
        ph = res["phases_ms"][name]
        ratio = 1.0 if name == "plain" else res[f"{name}_ratio"]
        rows.append((name, f"{res[f'{name}_step_ms']:.1f}", f"{ratio:.3f}", f"{ph['fwd_bwd']:.1f}",
                     f"{ph['end_step']:.2f}", f"{ph['opt_step']:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"paired per-round ratios: per_layer {res['paired_per_layer_ratio']:.3f}, per_token "
                 f"{res['paired_per_token_ratio']:.3f}; CPU-time ratios: per_layer {res['cpu_per_layer_ratio']:.3f}, "
                 f"per_token {res['cpu_per_token_ratio']:.3f}")
    lines.append(f"{res['rounds']} rounds (+{res['warmup_rounds']} warm-up), {res['tokens_per_step']} tokens/step, "
                 f"d_model {res['d_model']}, {res['n_layers']} layers, {res['params']:,} params, "
                 f"torch {res['torch_version']} on {res['torch_threads']} threads, {res['wall_s']} s, "
                 f"load average {res['loadavg_1m'][0]} -> {res['loadavg_1m'][1]} on {res['nproc']} CPUs")
    return "\n".join(lines)


# -- --profile: where gradloc's time goes ---------------------------------------------------------
def _profile_targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, label) of the gradloc functions to time; owners are looked up at call
    time by their callers, so wrapping the attribute times every call."""
    from gradloc.adapters import pytorch as adapter
    from gradloc.collector import layer_stats, step, token_hooks
    from gradloc.collector.rules import embedding, layer_norm, linear
    from gradloc.detector.detector import SpikeDetector

    out: list[tuple[Any, str, str]] = [
        (adapter.Monitor, "end_step", "Monitor.end_step (all of it)"),
        (adapter, "assemble", "collector.step.assemble (one packed host transfer)"),
        (layer_stats.LayerStatsCollector, "grad_pack", "LayerStatsCollector.grad_pack"),
        (layer_stats, "foreach_norms", "layer_stats.foreach_norms"),  # split by ord below
        (step, "summary_pack", "token_summary.summary_pack"),
        (step, "_parse", "collector.step._parse"),
        (adapter, "stack_step", "token_summary.stack_step"),
        (SpikeDetector, "observe", "SpikeDetector.observe"),
        (adapter.Monitor, "_emit_pending", "Monitor._emit_pending"),
        (layer_stats.LayerStatsCollector, "take_snapshot", "LayerStatsCollector.take_snapshot (optimizer pre-hook)"),
        (layer_stats.LayerStatsCollector, "update_sq", "LayerStatsCollector.update_sq (optimizer post-hook)"),
        (token_hooks, "_capture", "token_hooks._capture (forward hook)"),
        (token_hooks.MicroBatchScores, "add", "MicroBatchScores.add (backward hook)"),
        (layer_norm, "layer_norm_hat", "rules.layer_norm.layer_norm_hat"),
    ]
    for mod, cls in ((linear, "LinearRule"), (layer_norm, "LayerNormRule"), (embedding, "EmbeddingRule")):
        out.append((getattr(mod, cls), "score", f"{cls}.score (backward hook)"))
        out.append((getattr(mod, cls), "capture", f"{cls}.capture (forward hook)"))
        out.append((mod, "sq_norm_last", f"rules.sq_norm_last (from {cls})"))
    return out


class _Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Self:
        for owner, attr, label in _profile_targets():
            fn = getattr(owner, attr)
            self._saved.append((owner, attr, fn))
            setattr(owner, attr, self._wrap(fn, label, attr == "foreach_norms"))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved.clear()

    def _wrap(self, fn: Any, label: str, by_ord: bool) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            key = label
            if by_ord:
                order = args[1] if len(args) > 1 else kwargs.get("ord", 2.0)
                key = f"{label}(ord={order})"
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[key] = self.total.get(key, 0.0) + time.perf_counter() - t
                self.calls[key] = self.calls.get(key, 0) + 1

        return timed

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


def run_profile(cfg: OverheadConfig, steps: int = 10) -> dict[str, Any]:
    """Inclusive wall time per optimizer step of gradloc's functions (a nested function is also
    counted in its caller), for the per_layer and per_token variants; plus each variant's median
    step and phase times over the same steps. Timing wrappers add a few µs per call."""
    with torch_threads(cfg.threads):
        return _run_profile(cfg, steps)


def _run_profile(cfg: OverheadConfig, steps: int) -> dict[str, Any]:
    base = _base_model(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    out: dict[str, Any] = {"steps": steps, "torch_threads": torch.get_num_threads(),
                           "tokens_per_step": cfg.tokens_per_step, "d_model": cfg.d_model,
                           "n_layers": cfg.n_layers, "functions_ms_per_step": {}, "step_ms": {}, "phases_ms": {}}
    for name in VARIANTS:
        v = _Variant(name, copy.deepcopy(base), cfg)
        with _Timers() as timers:
            for r in range(cfg.warmup + steps):
                if r == cfg.warmup:
                    timers.reset()
                tokens = torch.randint(cfg.vocab, (cfg.micro_batches, cfg.batch, cfg.seq + 1), generator=gen)
                v.step([(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(cfg.micro_batches)],
                       cfg.tokens_per_step, record=r >= cfg.warmup)
            v.close()
        out["step_ms"][name] = _ms(v.step_s)
        out["phases_ms"][name] = {k: _ms(xs) for k, xs in v.phase_s.items()}
        if name != "plain":
            out["functions_ms_per_step"][name] = {
                k: {"ms": round(1000 * t / steps, 3), "calls_per_step": timers.calls[k] / steps}
                for k, t in sorted(timers.total.items(), key=lambda kv: -kv[1])}
    return out


def format_profile(res: dict[str, Any]) -> str:
    head = (f"{res['steps']} steps per variant, {res['tokens_per_step']} tokens/step, "
            f"{res['torch_threads']} threads; inclusive ms per optimizer step")
    lines = [head]
    for name in VARIANTS:
        ph = res["phases_ms"][name]
        lines.append(f"{name:9s} step {res['step_ms'][name]:.1f} ms (fwd+bwd {ph['fwd_bwd']:.1f}, "
                     f"end_step {ph['end_step']:.2f}, opt.step {ph['opt_step']:.2f})")
    for name, fns in res["functions_ms_per_step"].items():
        lines.append(f"\n{name}:")
        for label, v in fns.items():
            lines.append(f"  {v['ms']:9.2f} ms  {v['calls_per_step']:6.1f} calls  {label}")
    return "\n".join(lines)
