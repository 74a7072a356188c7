"""``python -m bench overhead --profile``: where gradloc's time goes, per function and step.

Each variant (plain, per_layer, per_token) runs alone for ``steps`` steps after the warm-up, with
timing wrappers around gradloc's functions.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Self

import torch

from bench import torch_threads
from bench.models import build_model
from bench.overhead import VARIANTS, OverheadConfig, _ms, make_batches
from bench.variants import make_variant


def _profile_targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, label) of the gradloc functions to time; owners are looked up at call
    time by their callers, so wrapping the attribute times every call."""
    from gradloc.collector import layer_stats, step, token_hooks, update_ratio
    from gradloc.collector.rules import embedding, layer_norm, linear, rms_norm
    from gradloc.detector.detector import SpikeDetector
    from gradloc.engine import fanout, monitor, token_path

    out: list[tuple[Any, str, str]] = [
        (monitor.Monitor, "end_step", "Monitor.end_step (all of it)"),
        (monitor, "assemble", "collector.step.assemble (one packed host transfer)"),
        (layer_stats.LayerStatsCollector, "grad_pack", "LayerStatsCollector.grad_pack"),
        (layer_stats, "foreach_norms", "layer_stats.foreach_norms"),  # split by ord below
        (step, "summary_pack", "token_summary.summary_pack"),
        (step, "_parse", "collector.step._parse"),
        (token_path, "stack_step", "token_summary.stack_step"),
        (SpikeDetector, "observe", "SpikeDetector.observe"),
        (fanout.Fanout, "release", "Fanout.release (the held step record out)"),
        (update_ratio.UpdateRatioTracker, "before_step", "UpdateRatioTracker.before_step (optimizer pre-hook)"),
        (update_ratio.UpdateRatioTracker, "after_step", "UpdateRatioTracker.after_step (optimizer post-hook)"),
        (token_hooks, "_capture", "token_hooks._capture (forward hook)"),
        (token_hooks.MicroBatchScores, "add", "MicroBatchScores.add (backward hook)"),
        (layer_norm, "layer_norm_hat", "rules.layer_norm.layer_norm_hat"),
    ]
    out.append((rms_norm, "rms_hat", "rules.rms_norm.rms_hat"))
    # the precursor statistics (forward hooks and the attention call's interception; the hooks' own dispatch is
    # not timed, only what they call)
    from gradloc.collector.precursors import measure, slots

    for fn in ("attention_logits", "attention_stats", "head_stats", "rms_stats", "router_stats"):
        out.append((measure, fn, f"precursors.measure.{fn} (forward)"))
    out.append((slots.StepSlots, "update", "precursors.StepSlots.update (forward)"))
    out.append((slots.StepSlots, "take", "precursors.StepSlots.take (end_step)"))
    for mod, cls in ((linear, "LinearRule"), (layer_norm, "LayerNormRule"), (embedding, "EmbeddingRule"),
                     (rms_norm, "HFRMSNormRule")):  # Llama's LlamaRMSNorm
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
    step and phase times over the same steps, on ``cfg.models[0]``. Timing wrappers add a few µs
    per call."""
    with torch_threads(cfg.threads):
        return _run_profile(cfg, steps)


def _run_profile(cfg: OverheadConfig, steps: int) -> dict[str, Any]:
    mcfg = cfg.model(cfg.models[0])
    base = build_model(mcfg, cfg.seed).to(cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    out: dict[str, Any] = {"model": mcfg.kind, "steps": steps, "torch_threads": torch.get_num_threads(),
                           "tokens_per_step": mcfg.tokens_per_step, "d_model": mcfg.d_model,
                           "n_layers": mcfg.n_layers, "functions_ms_per_step": {}, "step_ms": {}, "phases_ms": {}}
    for name in VARIANTS:
        v = make_variant(name, copy.deepcopy(base), cfg.lr, cfg.device)
        with _Timers() as timers:
            for r in range(cfg.warmup + steps):
                if r == cfg.warmup:
                    timers.reset()
                v.step(make_batches(mcfg, gen, cfg.device), mcfg.tokens_per_step, record=r >= cfg.warmup)
            v.close()
        out["step_ms"][name] = _ms(v.step_s)
        out["phases_ms"][name] = {k: _ms(xs) for k, xs in v.phase_s.items()}
        if name != "plain":
            out["functions_ms_per_step"][name] = {
                k: {"ms": round(1000 * t / steps, 3), "calls_per_step": timers.calls[k] / steps}
                for k, t in sorted(timers.total.items(), key=lambda kv: -kv[1])}
    return out


def format_profile(res: dict[str, Any]) -> str:
    head = (f"{res['model']}: {res['steps']} steps per variant, {res['tokens_per_step']} tokens/step, "
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
