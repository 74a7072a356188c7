"""``python -m bench overhead --memory``: peak memory of each variant, one fresh process per run.

``ru_maxrss`` is the high-water mark of a whole process, so every (model, variant, repeat) runs
in its own subprocess (``python -m bench.memory '<json spec>'``): build the seeded model, attach
the variant, run ``steps`` optimizer steps (past the first, where the update-ratio snapshot is
allocated in the optimizer pre-hook), report the peak RSS (and ``torch.cuda.max_memory_allocated``
on a GPU). Repeats of a variant are spread over the run (variant order rotates per repeat), two
processes at a time (each process' high-water mark is its own); the table gives the median peak,
its extra over ``plain`` and that extra as % of the parameter bytes, and the same for the RSS just
after attaching (before the first step: imports, hooks, the embedded agent's threads and store).
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MEMORY_VARIANTS = ("plain", "per_layer", "per_token", "per_token_full", "per_token_off")
# glibc serves allocations >= this from mmap and unmaps them on free (a fixed threshold also turns
# off the dynamic one, which grows after a big free and then keeps big buffers on the heap, whose
# pages stay resident): RSS then tracks live tensor bytes. Ignored by other C libraries.
PINNED_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class MemoryConfig:
    models: tuple[str, ...] = ("tinygpt", "llama")
    repeats: int = 2  # subprocesses per (model, variant) and allocator setting
    steps: int = 5  # optimizer steps per subprocess
    quick: bool = False
    seed: int = 0
    lr: float = 3e-4
    threads: int | None = 1
    device: str = "cpu"
    timeout_s: float = 600.0  # per subprocess
    jobs: int = 2  # subprocesses at a time: each one's ru_maxrss is its own, so they may overlap
    # also run every process with glibc's mmap threshold pinned (see PINNED_ENV): peaks then follow
    # the bytes actually live instead of where glibc's dynamic threshold happened to put big buffers
    pinned: bool = True

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.steps < 2 or self.jobs < 1:
            raise ValueError(f"need repeats >= 1 and steps >= 2 (past the first optimizer step), got {self}")


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def measure_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In the subprocess: one variant of one model for ``steps`` steps; peak memory in MiB."""
    import torch

    from bench.models import build_model, model_config, param_bytes
    from bench.overhead import make_batches
    from bench.variants import make_variant

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    device = spec["device"]
    mcfg = model_config(spec["model"], spec["quick"])
    after_import = _maxrss_mb()
    model = build_model(mcfg, spec["seed"]).to(device)
    variant = make_variant(spec["variant"], model, spec["lr"], device)
    after_setup = _maxrss_mb()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    try:
        for _ in range(spec["steps"]):
            variant.step(make_batches(mcfg, gen, device), mcfg.tokens_per_step, record=False)
        out = {"peak_rss_mb": _maxrss_mb(), "setup_rss_mb": after_setup, "import_rss_mb": after_import,
               "param_bytes": param_bytes(model)}
        if device.startswith("cuda"):
            out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    finally:
        variant.close()
    return out


def _run_child(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in PINNED_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if spec["malloc"] == "pinned":
        env.update(PINNED_ENV)
    if spec["threads"]:
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    proc = subprocess.run([sys.executable, "-m", "bench.memory", json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"memory child {spec['model']}/{spec['variant']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_memory(cfg: MemoryConfig, progress: Any = None) -> dict[str, Any]:
    load_start, start = os.getloadavg()[0], time.perf_counter()
    base = {k: v for k, v in asdict(cfg).items() if k in ("quick", "seed", "lr", "threads", "device", "steps")}
    n, mallocs = len(MEMORY_VARIANTS), ("default", "pinned") if cfg.pinned else ("default",)
    specs = [{**base, "model": model, "variant": variant, "malloc": malloc} for model in cfg.models
             for r in range(cfg.repeats) for malloc in mallocs
             for variant in MEMORY_VARIANTS[r % n:] + MEMORY_VARIANTS[:r % n]]  # the order rotates per repeat
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    with ThreadPoolExecutor(cfg.jobs) as pool:
        for i, (spec, out) in enumerate(zip(specs, pool.map(lambda s: _run_child(s, cfg.timeout_s), specs))):
            runs.setdefault((spec["model"], spec["variant"], spec["malloc"]), []).append(out)
            if progress is not None:
                progress(i, len(specs), {k: spec[k] for k in ("model", "variant", "malloc")}
                         | {"peak_rss_mb": round(out["peak_rss_mb"], 1)})
    models = {model: _summarize(model, runs, mallocs) for model in cfg.models}
    return {"memory": models, "repeats": cfg.repeats, "steps": cfg.steps, "jobs": cfg.jobs, "device": cfg.device,
            "pinned_env": PINNED_ENV if cfg.pinned else None,
            "wall_s": round(time.perf_counter() - start, 1), "nproc": os.cpu_count(),
            "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)]}


def _summarize(model: str, runs: dict[tuple[str, str, str], list[dict[str, Any]]],
               mallocs: tuple[str, ...]) -> dict[str, Any]:
    """Medians over the repeats; keys of the pinned-threshold runs start with ``pinned_``."""
    from bench.variants import computes

    pbytes = runs[(model, "plain", "default")][0]["param_bytes"]
    out: dict[str, Any] = {"param_mb": round(pbytes / 2**20, 2), "variants": {}}
    for v in MEMORY_VARIANTS:
        row: dict[str, Any] = {"computes": computes(v)}
        for malloc in mallocs:
            prefix = "" if malloc == "default" else f"{malloc}_"
            mine, plain = runs[(model, v, malloc)], runs[(model, "plain", malloc)]
            row[f"{prefix}peak_rss_mb_runs"] = [round(r["peak_rss_mb"], 1) for r in mine]
            for k in ["peak_rss_mb", "setup_rss_mb"] + (["cuda_peak_mb"] if "cuda_peak_mb" in mine[0] else []):
                med = statistics.median(r[k] for r in mine)
                extra = med - statistics.median(r[k] for r in plain)
                row[f"{prefix}{k}"] = round(med, 1)
                row[f"extra_{prefix}{k}"] = round(extra, 1)
                row[f"extra_{prefix}{k}_pct_params"] = round(100.0 * extra * 2**20 / pbytes, 1)
        out["variants"][v] = row
    return out


def format_memory(res: dict[str, Any]) -> str:
    lines = []
    for model, m in res["memory"].items():
        lines.append(f"{model}: parameters {m['param_mb']} MiB; median of {res['repeats']} processes, "
                     f"{res['steps']} steps each")
        plain = m["variants"]["plain"]
        cols = [(label, key) for label, key in (("RSS", "peak_rss_mb"), ("RSS pinned", "pinned_peak_rss_mb"),
                                                ("CUDA", "cuda_peak_mb")) if key in plain]
        head = ["variant"] + [f"{label} {x}" for label, _ in cols for x in ("peak MiB", "extra", "% params")]
        rows = [tuple(head + ["RSS at attach: extra"])]
        for v, row in m["variants"].items():
            cells = [v] + [x for _, k in cols for x in (f"{row[k]:.1f}", f"{row[f'extra_{k}']:+.1f}",
                                                        f"{row[f'extra_{k}_pct_params']:+.1f}")]
            rows.append(tuple(cells + [f"{row['extra_setup_rss_mb']:+.1f}"]))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows] + [""]
    if res.get("pinned_env"):
        lines.append(f"RSS pinned: the same runs with {res['pinned_env']} (RSS follows the live bytes)")
    lines.append(f"{res['wall_s']} s, load average {res['loadavg_1m'][0]} -> {res['loadavg_1m'][1]} "
                 f"on {res['nproc']} CPUs")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(measure_child(json.loads(sys.argv[1]))))
