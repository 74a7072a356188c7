"""DeepSpeed from a stock JSON config around a Hugging Face Llama: the config DeepSpeed's getting-started page
shows (batch sizes, an ``optimizer`` section, ZeRO stage, gradient clipping), nothing of the project's own —
only ``torch_adam`` (DeepSpeed's fused Adam is a CUDA kernel; its documented switch to torch's Adam) and the
logging interval. The loop is tests/distributed/ds_job.py's (``engine.backward``/``engine.step`` per micro-batch,
``end_step`` at the boundary), the culprit planted on the last rank after ``HEALTHY`` steps, the default
detector."""
from __future__ import annotations

from typing import Any

from tests.distributed import ds_job

HEALTHY = 32
STEPS = HEALTHY + 2


def stock_config(stage: int, world: int) -> dict[str, Any]:
    return {
        "train_batch_size": ds_job.B * ds_job.M * world,
        "gradient_accumulation_steps": ds_job.M,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }


def llama_engine(stage: int, bf16: bool = False) -> Any:
    import deepspeed
    import torch.distributed as dist

    from tests.defaults.ddp_job import llama

    model = llama(ds_job.VOCAB)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=stock_config(stage, dist.get_world_size()))
    return engine


def run_all(rank: int, world: int, stages: tuple[int, ...]) -> dict[int, dict]:
    """Each ZeRO stage with gradloc and without it; picklable figures."""
    import torch

    import gradloc

    plant = (world - 1, HEALTHY, 1, 2, 5)
    out = {}
    for stage in stages:
        kw = dict(build=llama_engine, logits=lambda module, x: module(input_ids=x).logits,
                  detector=gradloc.DetectorConfig())
        watched = ds_job.train(rank, stage, STEPS, plant, True, **kw)
        plain = ds_job.train(rank, stage, STEPS, plant, False, **kw)
        out[stage] = {
            "kind": watched["kind"], "ds_norms": watched["ds_norms"],
            "same_params": all(torch.equal(p, watched["params"][n]) for n, p in plain["params"].items()),
            "steps": [{"norm": r.record.global_norm, "incident": r.incident is not None,
                       "loc": None if r.incident is None else {
                           "status": str(r.incident.localization.status), "probes": r.incident.localization.probes,
                           "note": r.incident.localization.note, "explained": r.incident.localization.explained_share,
                           "culprits": [(c.rank, c.micro_batch, c.sample, c.position)
                                        for c in r.incident.localization.culprits]}}
                      for r in watched["reports"]]}
    return out
