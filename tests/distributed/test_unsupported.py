"""Parallel layouts gradloc cannot answer right are refused at attach, on every rank, with the reason
(gradloc/parallel/unsupported.py): context parallelism laid out as torchtitan lays it out (FSDP2 over the
flattened ``dp_shard_cp`` dim: no parameter is split along ``cp``, so before this check the job was accepted as
plain FSDP2 and its per-token scores read a sequence shard as the whole row), and several pipeline stages on one
rank (the interleaved and zero-bubble schedules)."""
from __future__ import annotations

from tests.distributed.launch import run


def _watch(model) -> str:
    """What ``watch`` says on this rank: "attached", or its UnsupportedModelError."""
    import gradloc

    try:
        gradloc.watch(model, store=False).close()
        return "attached"
    except gradloc.UnsupportedModelError as exc:
        return str(exc)


def _cp(rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard


    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # torchtitan's FSDP mesh under CP
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    fully_shard(model, mesh=flat)
    return _watch(model)


def test_context_parallel_as_torchtitan_lays_it_out_is_refused_on_every_rank():
    for msg in run(_cp, 4, timeout_s=180):
        assert "context-parallel dim (cp = 2)" in msg and "context parallelism is not supported" in msg, msg


def _interleaved(rank, world):
    import torch
    from torch.distributed.pipelining import PipelineStage


    torch.manual_seed(0)
    stages = [PipelineStage(torch.nn.Linear(8, 8), rank + world * v, 2 * world, torch.device("cpu"))
              for v in range(2)]  # ScheduleInterleaved1F1B's layout: stage rank + world·v on this rank
    return _watch(stages[0])


def test_several_pipeline_stages_on_one_rank_are_refused_on_every_rank():
    for msg in run(_interleaved, 2, timeout_s=180):
        assert "4 stages on 2 ranks" in msg and "one stage per rank" in msg, msg


def _megatron_cp(rank, world):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from tests.distributed.megatron_job import megatron

    ps, _, _ = megatron()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=2)
    torch.manual_seed(0)
    return _watch(DistributedDataParallel(torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))))


def test_megatron_context_parallel_is_refused_on_every_rank():
    import pytest

    pytest.importorskip("megatron.core")
    env = {"NO_VCS_VERSION": "1"}  # as test_megatron.py: no `git rev-parse` at megatron's import
    for msg in run(_megatron_cp, 2, timeout_s=180, env=env):
        assert "Megatron's context_parallel_size is 2" in msg, msg


def _megatron_sp_embedding(rank, world):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    from tests.distributed.megatron_job import MegatronToy, setup

    setup(2)
    model = MegatronToy(2, sp=True)
    cfg = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True)
    model.tok2 = VocabParallelEmbedding(16, 8, init_method=lambda w: w.zero_(), config=cfg,
                                        reduce_scatter_embeddings=True)
    return _watch(model)


def test_megatron_sequence_parallel_with_a_layer_it_cannot_score_is_refused_on_every_rank():
    """Megatron SP (parallel/megatron_sp.py): a VocabParallelEmbedding reduce-scattering into the SP region has no
    per-token rule there; the model is refused at attach, naming the layer, on both ranks."""
    import pytest

    pytest.importorskip("megatron.core")
    env = {"NO_VCS_VERSION": "1"}
    for msg in run(_megatron_sp_embedding, 2, timeout_s=180, env=env):
        assert "tok2 (VocabParallelEmbedding) under Megatron sequence_parallel=True" in msg, msg
