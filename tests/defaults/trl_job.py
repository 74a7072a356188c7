"""TRL's own ``GRPOTrainer`` with a reference model (``beta=0.1``: the KL term against a frozen reference TRL loads
itself) on 2 gloo ranks: tests/integrations/test_trl.py's setup (a tiny random Llama policy, TRL's defaults
otherwise: ``loss_type="dapo"``, ``max_grad_norm=1``, GA 2, ``num_iterations=2``, no vLLM) under the launcher
(``use_cpu=True``: accelerate's MULTI_CPU, so the Trainer wraps the policy in DDP), the default detector. The
culprit: test_trl's stale old log-prob (one token's ratio e^8 ≈ 2981), planted on the last rank only, at its
first optimizer step from ``K`` (after the detector's warm-up) with a negative-advantage completion. The same
run without gradloc (the bitwise check)."""
from __future__ import annotations

import os
import time
from typing import Any

PLANT_OFF = (-1, -1, -1, -1, "")  # `planted` on the other ranks: test_trl's plant never fires there


def train(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    from tests.integrations import test_trl as t

    transformers.logging.set_verbosity_error()
    w = t.make_world()

    def trainer(cls: type, tag: str, **kw: Any) -> Any:
        model = t.policy(w)
        ref = os.path.join(out_dir, f"ref-{tag}")
        torch.manual_seed(9)
        LlamaForCausalLM(w.config).save_pretrained(ref)  # the reference TRL loads from the policy's path; transformers
        torch.distributed.barrier()                      # writes it on rank 0 only when a process group exists
        model.config._name_or_path = ref
        tr = cls(model=model, reward_funcs=t.reward, args=t.grpo_args(os.path.join(out_dir, f"{tag}-{rank}"),
                                                                       beta=0.1),
                 train_dataset=t.dataset(w), processing_class=w.tok, **kw)
        if rank != world - 1:
            tr.planted = PLANT_OFF
        tr.train()
        return tr

    class Timed(t.StaleGradloc):
        """Times gradloc's end of step (probes included) at each optimizer step."""

        seconds: dict[int, float] = {}

        def _gradloc_end_step(self, model: Any) -> None:
            t0 = time.perf_counter()
            super()._gradloc_end_step(model)
            self.seconds[self.state.global_step] = time.perf_counter() - t0

    watched = trainer(Timed, "gl", gradloc=t.GRADLOC, gradloc_sample_ids="pid")
    plain = trainer(t._Stale, "plain")
    mon = watched.gradloc
    loc = [(i.step, str(i.scope), i.localization) for i in mon.incidents]
    return {
        "distributed_type": str(watched.accelerator.distributed_type), "wrapped": type(watched.model_wrapped).__name__,
        "ref_model": watched.ref_model is not None, "kl_logged": any("kl" in h for h in watched.state.log_history),
        "kind": mon.job.kind, "errors": watched.gradloc_errors, "counters": dict(mon.counters),
        "broken": mon.comm.broken if mon.comm is not None else "", "seconds": dict(watched.seconds),
        "planted": watched.planted, "expected": watched.expected, "incidents": loc,
        "pid": f"p{w.prompts.index(watched.planted[4])}" if watched.planted != PLANT_OFF else None,
        "norms": [r.global_norm for r in mon.history],
        "logged": [h["grad_norm"] for h in plain.state.log_history if "grad_norm" in h],
        "same_planted": watched.planted == plain.planted,
        "same_params": all(torch.equal(p0, p1) for p0, p1 in zip(plain.model.parameters(), watched.model.parameters(),
                                                                  strict=True)),
    }
