"""The demo's DeepSpeed engine (``gradloc-agent demo --backend deepspeed``; needs the deepspeed extra).

The rank processes already have a gloo process group (gradloc.demo.spawn), which
``deepspeed.initialize`` adopts. DeepSpeed JIT-builds its CPU shm comm op on first use (1.5–3 min
on a 2-core machine, once per ``TORCH_EXTENSIONS_DIR``): the first DeepSpeed demo takes that long
before its first step.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradloc.errors import ConfigError


def engine(model: nn.Module, stage: int, batch: int, micro_batches: int, lr: float) -> Any:
    try:
        import deepspeed
    except ImportError as exc:
        raise ConfigError("--backend deepspeed needs the deepspeed extra: pip install 'gradloc[deepspeed]'") from exc
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every parameter, as in a large model
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": micro_batches,
              "zero_optimization": zero, "gradient_clipping": 1.0, "steps_per_print": 10**9}
    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=lr), config=config)
    return eng
