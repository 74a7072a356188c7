"""DistributedDataParallel with its defaults (and each documented option) around a Hugging Face Llama, 4 gloo ranks
(the model compiled whole by ``torch.compile(DDP(model))``: 2 ranks).

``DDP(model)`` keeps ``broadcast_buffers=True``: the first forward after a synchronised backward broadcasts rank
0's buffers (``rotary_emb.inv_freq`` here), a collective inside ``forward``. Before gradloc's probes bypassed it,
the spike step of this very job crashed or stalled every rank on a collective deadline (the probing rank's
broadcast paired with another rank's next training forward). Each variant (tests/defaults/ddp_job.py), the token
planted on the last rank after 32 healthy steps:

- the job's global norm equals the norm of the gradient DDP delivers (after its all-reduce and, with the fp16
  compression hook, after decompression: gradloc reports what the optimizer sees) and ``clip_grad_norm_``'s
  return value, on every step and rank;
- one job incident, at the planted step, located on the last rank at the planted token in ≤ 3 probes, with the share
  measured against the job's gradient; nothing before it;
- no collective deadline hit (gradloc's communicators intact) and the spike step well inside the deadline;
- the parameters bitwise those of the same run without gradloc.
"""
from __future__ import annotations

import pytest

from tests.defaults import checks
from tests.defaults.ddp_job import variants
from tests.distributed.launch import run

pytest.importorskip("transformers")

COMPILED = "compiled"  # inductor compiles each rank's model twice (with and without gradloc): 2 ranks, ~100 s
WORLDS = {name: 2 if name == COMPILED else 4 for name in variants()}
_RUNS: dict[int, list[dict]] = {}


def launch(variant: str) -> list[dict]:
    """Every eager variant in one launch of 4 ranks, the compiled one in a launch of 2."""
    from tests.defaults.ddp_job import run_all

    world = WORLDS[variant]
    if world not in _RUNS:
        names = [n for n, w in WORLDS.items() if w == world]
        _RUNS[world] = run(run_all, world, names, timeout_s=1200)
    return _RUNS[world]


@pytest.mark.parametrize("variant", list(variants()))
def test_ddp_variant_reports_exact_norms_and_locates_the_token_on_its_rank(variant):
    ranks = launch(variant)
    assert all(r[variant]["with"]["placements"] == ["whole"] for r in ranks)
    checks.norms_location_and_deadline(ranks, variant, "ddp")


@pytest.mark.parametrize("variant", list(variants()))
def test_ddp_variant_trains_bitwise_as_without_gradloc(variant):
    checks.bitwise(launch(variant), variant)
