"""What dynamo's guards on module hook dicts cost (gradloc turns them on at watch(): collector/compiled.py
``guard_hooks``): the guard check of one compiled TinyGPT call, hook guards off (torch's default) and on.

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m bench compile-guards [n_layers]

Each setting in its own process (the config is read when the guards are built)."""
from __future__ import annotations

import subprocess
import sys
import time


def _one(skip: bool, layers: int, calls: int = 20000) -> float:
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from tests.helpers import make_data, tiny_gpt

    torch.set_num_threads(1)
    torch._dynamo.config.skip_nnmodule_hook_guards = skip
    model = tiny_gpt(0, n_layers=layers)
    x = make_data(1, 1).x[0, 0]
    torch.compile(model, backend="aot_eager")(x).sum().backward()
    entry = _debug_get_cache_entry_list(type(model).forward)[0]
    frame = {"self": model, "idx": x, "cu_seqlens": None}  # TinyGPT.forward's locals
    assert entry.guard_manager.check(frame)
    t = time.perf_counter()
    for _ in range(calls):
        entry.guard_manager.check(frame)
    return (time.perf_counter() - t) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    """``python -m bench compile-guards [n_layers]`` (a child: ``n_layers on|off``)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) > 1:  # a child: one setting
        print(f"{_one(args[1] == 'off', int(args[0])):.1f}")
        return 0
    layers = int(args[0]) if args else 8
    for rep in range(2):
        got = {s: subprocess.run([sys.executable, "-m", "bench.compile_guards", str(layers), s], capture_output=True,
                                 text=True, check=True).stdout.strip() for s in ("off", "on")}
        print(f"TinyGPT {layers} blocks, guard check per compiled call: hook guards off {got['off']} us, "
              f"on {got['on']} us (run {rep + 1})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
