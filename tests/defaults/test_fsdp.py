"""FSDP2 as PyTorch's example builds it, and HSDP (a (2, 2) ("replicate", "shard") mesh), around a Hugging Face
Llama, 4 gloo ranks (tests/defaults/fsdp_job.py), the token planted on the last rank after 32 healthy steps, the
default detector: tests/defaults/checks.py's checks, as DDP's — gradloc's norm is the whole gradient's and
``clip_grad_norm_``'s, one job incident located on data rank 3 in ≤ 3 probes, no collective deadline, training
bitwise as without gradloc."""
from __future__ import annotations

import pytest

from tests.defaults import checks
from tests.defaults.fsdp_job import variants
from tests.distributed.launch import run

pytest.importorskip("transformers")

WORLD = 4
_RUNS: list[list[dict]] = []


def launch() -> list[dict]:
    """Both variants in one launch of 4 ranks."""
    from tests.defaults.fsdp_job import run_all

    if not _RUNS:
        _RUNS.append(run(run_all, WORLD, list(variants()), timeout_s=1200))
    return _RUNS[0]


@pytest.mark.parametrize("variant", list(variants()))
def test_fsdp_variant_reports_exact_norms_and_locates_the_token_on_its_rank(variant):
    ranks = launch()
    want = {"fsdp2": "(Shard(dim=0),)", "hsdp": "(Replicate(), Shard(dim=0))"}[variant]
    assert all(r[variant]["with"]["placements"] == [want] for r in ranks)  # the sharding each variant asked for
    checks.norms_location_and_deadline(ranks, variant, "fsdp")


@pytest.mark.parametrize("variant", list(variants()))
def test_fsdp_variant_trains_bitwise_as_without_gradloc(variant):
    checks.bitwise(launch(), variant)
