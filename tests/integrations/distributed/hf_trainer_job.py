"""A real ``transformers.Trainer`` (GradlocTrainer) on W gloo CPU processes: DDP through accelerate.

Each rank (launched by tests/distributed/launch.py, process group already initialized) builds the same
byte-level BPE tokenizer and the same tiny random ``LlamaForCausalLM`` from a config, pre-trains it for
60 plain-loop steps (tests/tiny_llama.py) on a cycle of two sentences (identical on every rank: same seed, one
thread), then fine-tunes it with ``TrainingArguments(use_cpu=True)``: accelerate sees ``LOCAL_RANK``
and the initialized gloo group, so the Trainer wraps the model in ``DistributedDataParallel`` and
shards the batches (rank r gets global batch ``j·W + r`` as its micro-batch j).

The planted culprit (``plant``): the last rank's micro-batch ``MB`` of step ``K``, row ``ROW``, input index
``POS`` replaced by ``Z``, a byte that never occurs in the corpus — a corrupted token on one rank.
Logits position ``POS - 1`` scores it. ``train`` returns what the test checks, by value.
"""
from __future__ import annotations

import os
import time
from typing import Any

from tests.tiny_llama import SEQ, labels, pretrained, windows

B, GA = 4, 2
K, MB, ROW, POS = 12, 1, 2, 17  # planted on the last rank: step K, micro-batch MB, row ROW, input index POS
STEPS = K + 2
WARMUP = 8  # detector warm-up steps (the default 25 would double the run)
UID0 = 1000  # dataset row k has uid UID0 + k


def planted_row(world: int) -> int:
    """The dataset row of the culprit, on the last rank (W − 1, a non-zero rank): its micro-batch j = K·GA + MB is
    global batch j·W + W − 1."""
    return ((K * GA + MB) * world + world - 1) * B + ROW


def _dataset(tok: Any, cycle: Any, period: int, world: int, plant: bool) -> list[dict]:
    import torch

    n = STEPS * GA * B * world
    x = windows(cycle, torch.randint(0, period, (n,), generator=torch.Generator().manual_seed(0)))
    if plant:
        x[planted_row(world), POS] = tok.convert_tokens_to_ids("Z")
    return [dict(input_ids=x[i], attention_mask=torch.ones(SEQ, dtype=torch.long), labels=labels(x[i]),
                 uid=UID0 + i) for i in range(n)]


def train(rank: int, world: int, out_dir: str, plant: bool = True) -> dict:
    """Fine-tune with gradloc and, from the same weights and data, without it; returns what the test checks."""
    import torch
    import transformers
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    import gradloc
    from gradloc.integrations.transformers import GradlocTrainer

    transformers.logging.set_verbosity_error()
    t0 = time.monotonic()
    w = pretrained()
    tok, config, weights = w.tok, w.config, w.weights
    rows = _dataset(tok, w.cycle, w.period, world, plant)
    t_setup = time.monotonic() - t0

    def run(trainer_cls: type, **kw: Any) -> tuple[Trainer, dict, float, str]:
        model = LlamaForCausalLM(config)
        model.load_state_dict(weights)
        args = TrainingArguments(output_dir=os.path.join(out_dir, f"{trainer_cls.__name__}-{rank}"), use_cpu=True,
                                 report_to="none", per_device_train_batch_size=B, gradient_accumulation_steps=GA,
                                 max_steps=STEPS, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
                                 save_strategy="no", train_sampling_strategy="sequential", max_grad_norm=1.0, seed=0,
                                 disable_tqdm=True, dataloader_num_workers=0)
        trainer = trainer_cls(model=model, args=args, train_dataset=rows, processing_class=tok, **kw)
        t = time.monotonic()
        trainer.train()
        wrapped = type(trainer.model_wrapped).__name__
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return trainer, params, time.monotonic() - t, wrapped

    watched, params, t_watched, wrapped = run(
        GradlocTrainer, gradloc=dict(job="hf-ddp", store=False, detector=gradloc.DetectorConfig(warmup=WARMUP)),
        gradloc_sample_ids="uid")
    mon = watched.gradloc
    _, plain_params, t_plain, _ = run(Trainer)
    return {
        "wrapped": wrapped, "ddp": wrapped == DistributedDataParallel.__name__,
        "distributed_type": str(watched.accelerator.distributed_type), "world": watched.args.world_size,
        "kind": mon.job.kind, "errors": watched.gradloc_errors, "counters": dict(mon.counters),
        "incidents": [(i.step, i.scope, i.localization) for i in mon.incidents],
        "norms": [r.global_norm for r in mon.history],
        "logged": [h["grad_norm"] for h in watched.state.log_history if "grad_norm" in h],
        "same_params": all(torch.equal(p, params[n]) for n, p in plain_params.items()),
        "seconds": {"setup": t_setup, "watched": t_watched, "plain": t_plain},
    }
