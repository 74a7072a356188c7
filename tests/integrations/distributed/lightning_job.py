"""A real ``lightning.pytorch.Trainer`` with ``strategy="ddp"`` on W gloo CPU processes, GradlocCallback attached.

Each rank (launched by tests/distributed/launch.py: ``LOCAL_RANK`` set and the gloo group initialized, so
Lightning's environment creates no processes and reuses the group) builds the tiny pre-trained Llama of
tests/tiny_llama.py and fits the LightningModule of tests/integrations/lit_llama.py. Lightning wraps it in
``DistributedDataParallel``. Each rank reads its ``DistributedSampler(shuffle=False)`` slice (given here with
``use_distributed_sampler=False``: Lightning's own sampler shuffles the training set): rank r's micro-batch j
holds rows ``(j·B + i)·W + r``. The planted culprit: the last rank's micro-batch ``MB`` of step ``K``,
row ``ROW``, input index ``POS`` is ``Z`` (a corrupted token on one rank). ``train`` returns what the test
checks, by value; the same fit without the callback gives the reference parameters.
"""
from __future__ import annotations

from typing import Any

B, GA = 4, 2
K, MB, ROW, POS = 12, 1, 2, 17
STEPS = K + 2
UID0 = 1000


def planted_row(world: int) -> int:
    return ((K * GA + MB) * B + ROW) * world + world - 1  # the last rank's row ROW of its micro-batch K·GA + MB


def train(rank: int, world: int) -> dict[str, Any]:
    import torch

    from gradloc.config import DetectorConfig
    from gradloc.integrations.lightning import GradlocCallback
    from tests.integrations.lit_llama import LitLlama, fit
    from tests.tiny_llama import pretrained, rows

    w = pretrained()
    data = rows(w, STEPS * GA * B * world, plant_row=planted_row(world), pos=POS, uid0=UID0)
    settings = dict(max_steps=STEPS, accumulate_grad_batches=GA, gradient_clip_val=1.0, devices=world,
                    strategy="ddp", use_distributed_sampler=False)
    cb = GradlocCallback(job="lightning-ddp", store=False, detector=DetectorConfig(warmup=8))
    watched = LitLlama(w)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    trainer = fit(watched, data, B, [cb], sampler=sampler, **settings)
    mon = cb.monitor
    plain = LitLlama(w)
    fit(plain, data, B, [], sampler=sampler, **settings)
    return {
        "strategy": type(trainer.strategy).__name__, "world": trainer.world_size, "kind": mon.job.kind,
        "counters": dict(mon.counters), "degraded": cb.degraded, "steps": len(mon.history),
        "incidents": [(i.step, str(i.scope), i.localization) for i in mon.incidents],
        "norms": [r.global_norm for r in mon.history],
        "same_params": all(torch.equal(p0, p1) for p0, p1 in zip(plain.parameters(), watched.parameters(), strict=True)),
    }
