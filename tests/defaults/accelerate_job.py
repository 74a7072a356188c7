"""Hugging Face Accelerate on its own, set up as its docs set it up: ``Accelerator(gradient_accumulation_steps=2)``
(every other argument its default), ``accelerator.prepare(model, optimizer, dataloader)``, and the docs' loop —
``with accelerator.accumulate(model)``, ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_`` when
``sync_gradients``, ``optimizer.step()``, ``optimizer.zero_grad()`` — with gradloc's two changed lines
(gradloc/integrations/accelerate.py: ``gl.accumulate(batch)``, ``gl.backward(loss)``).

Each rank is launched by tests/distributed/launch.py (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, an
initialized gloo group, as torchrun leaves it) with ``ACCELERATE_USE_CPU=true``, the one variable
``accelerate launch --cpu`` adds: without it ``Accelerator()`` on a machine with no GPU takes the ranks for
separate single processes (``DistributedType.NO``, no DDP, no gradient all-reduce — measured here), so a CPU job
is launched that way. ``prepare`` wraps the model in ``DistributedDataParallel`` with its defaults and shards the
loader (rank r gets global batch ``j·W + r`` as its j-th micro-batch).

The model is tests/tiny_llama.py's pre-trained Llama (it has buffers: ``rotary_emb.inv_freq``), the data windows
of its corpus; the culprit: the last rank's micro-batch ``MB`` of step ``K`` (after ``K`` healthy steps), row
``ROW``, input index ``POS`` replaced by ``Z``, a byte the corpus never has. The default detector. Runs with
gradloc and then without it (the bitwise check); picklable figures back."""
from __future__ import annotations

import time
from typing import Any

B, GA = 4, 2
K, MB, ROW, POS = 32, 1, 2, 17
STEPS = K + 2
UID0 = 1000
ENV = {"ACCELERATE_USE_CPU": "true"}  # what `accelerate launch --cpu` sets (accelerate/utils/launch.py)


def planted_row(world: int) -> int:
    """The dataset row of the culprit: the last rank's micro-batch j = K·GA + MB is global batch j·W + W − 1."""
    return ((K * GA + MB) * world + world - 1) * B + ROW


def train(rank: int, world: int, monitor: bool, plant: bool = True) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from gradloc.integrations.accelerate import GradlocAccelerate, causal_lm_token_loss
    from gradloc.integrations.loop import hf_view
    from tests.tiny_llama import causal_lm, pretrained, rows

    w = pretrained()
    data = rows(w, STEPS * GA * B * world, plant_row=planted_row(world) if plant else None, pos=POS, uid0=UID0)
    AcceleratorState._reset_state(True)  # a fresh Accelerator per run in this process (its state is process-wide)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=GA)
    model = causal_lm(w)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=B, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    gl = None
    if monitor:
        gl = GradlocAccelerate(
            accelerator, model, optimizer, job="accelerate-defaults", store=False,
            token_loss=lambda m, b: causal_lm_token_loss(m(input_ids=b["input_ids"]).logits, b["labels"]),
            view=lambda b: {**hf_view(b), "sample_ids": [str(u) for u in b["uid"].tolist()]}, decode=w.tok)
    clip_norms: list[float] = []
    seconds: list[float] = []  # each optimizer step, its first micro-batch to its optimizer step
    t0 = time.perf_counter()
    for batch in loader:
        with gl.accumulate(batch) if gl else accelerator.accumulate(model):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            gl.backward(loss) if gl else accelerator.backward(loss)
            if accelerator.sync_gradients:
                clip_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            seconds.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
    out: dict[str, Any] = {
        "distributed_type": str(accelerator.distributed_type), "processes": accelerator.num_processes,
        "wrapped": type(model).__name__, "clip": clip_norms, "seconds": seconds,
        "params": {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}}
    if gl is not None:
        gl.close()  # the last step's record joins the history at close
        mon = gl.monitor
        out.update(kind=mon.job.kind, counters=dict(mon.counters), errors=gl.driver.errors,
                   broken=mon.comm.broken if mon.comm is not None else "",
                   norms=[r.global_norm for r in mon.history],
                   incidents=[(i.step, i.scope, i.localization) for i in mon.incidents])
    return out


def run_both(rank: int, world: int) -> dict[str, Any]:
    """With gradloc, then the same run without it."""
    return {"with": train(rank, world, True), "without": train(rank, world, False)}


def plain_type(rank: int, world: int) -> str:
    """What ``Accelerator()`` makes of these ranks without ``ACCELERATE_USE_CPU`` (the module docstring)."""
    from accelerate import Accelerator

    return str(Accelerator().distributed_type)
