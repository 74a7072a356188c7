"""torchtitan 0.3.0's own models, built small on the CPU, and its own parallelisms on gloo (the test extra;
``HAS_TITAN`` says whether it is here).

Models: ``qwen3_moe`` (Qwen3-MoE), ``deepseek_v3`` (DeepSeek-V3) and ``llama3`` (Llama 3), their configs made by
torchtitan's own builders (``_build_qwen3_moe_layers``, ``_build_dsv3_layers``, ``_build_llama3_layers``) with smaller dimensions than its debug flavours
(``debugmodel_moe`` holds 300 M parameters of experts: too large for a 2-core test), vocab ``VOCAB``, weights
filled on the CPU from a seed (the same in every process). Given ``parallelism=parallelism_config(...)``, a
model's config first receives torchtitan's sharding plan (``update_from_config``, as its Trainer does).

Parallelism, all torchtitan's: ``parallel_dims`` (``ParallelDims`` and its meshes), ``parallelize``
(``parallelize_llama`` / ``parallelize_qwen3`` / ``parallelize_deepseekv3``: TP, EP, and FSDP, always, even on a 1-rank ``fsdp`` mesh),
``pipeline`` (``pipeline_llm``: its stage split, its schedules), ``loss_fn`` (``CrossEntropyLoss``) and
``grad_norm`` (``clip_grad_norm_``). Float32 throughout (no mixed precision), no compile, no activation
checkpointing.

CPU workarounds (DESIGN.md §8 and here): attention swapped to ``ScaledDotProductAttention`` (flex attention has
no CPU backward); ``device_type = "cpu"`` in torchtitan's modules before any mesh is built (``cpu_titan``);
the ``partial_dtensor`` SPMD backend (``spmd_types`` leaves plain tensors, which ``fully_shard`` refuses); FSDP
told to sum (gloo has no PREMUL_SUM); torch's "fake" process-group backend registered (torchtitan puts the
size-1 mesh dims on it; only its own fake-mode launcher imports it). torchtitan's grouped experts still compute
in bf16 (``GroupedExperts`` casts itself). Everything else is torchtitan's code.
"""
from __future__ import annotations

import importlib.util

import torch
from torch import nn

HAS_TITAN = importlib.util.find_spec("torchtitan") is not None
VOCAB = 128


def cpu_titan() -> None:
    """torchtitan reads its device type at import (``cuda`` when none is found … on a CPU machine it still
    picks cuda for meshes): point every module that copied it at the CPU."""
    import torchtitan.distributed.parallel_dims as pd
    import torchtitan.tools.utils as tu

    tu.device_type = "cpu"
    pd.device_type = "cpu"


def _sdpa(layers: list) -> list:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def _materialize(cfg, seed: int, parallelism=None) -> nn.Module:  # noqa: ANN001
    """Build on meta, then fill on the CPU from ``seed``: the same weights in every process. With a
    ``ParallelismConfig``, first let torchtitan write its sharding plan into the config (as its Trainer does)."""
    if parallelism is not None:
        from types import SimpleNamespace

        cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def qwen3_moe_config(n_layers: int = 2, dim: int = 64, experts: int = 8, top_k: int = 2, hidden: int = 32):  # noqa: ANN201
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    hd = 16
    layers = _build_qwen3_moe_layers(n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=hd,
                                     moe_hidden_dim=hidden, num_experts=experts, top_k=top_k, attn_backend="flex",
                                     moe_comm_backend="standard",
                                     rope=CosSinRoPE.Config(dim=hd, max_seq_len=256, theta=1e6))
    return Qwen3Model.Config(vocab_size=VOCAB, dim=dim, norm=_qwen3_norm(dim),
                             tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                                             param_init=_EMBEDDING_INIT),
                             lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_LINEAR_INIT),
                             layers=_sdpa(layers))


def qwen3_moe(seed: int = 0, parallelism=None, **kw) -> nn.Module:  # noqa: ANN001
    """torchtitan's Qwen3-MoE (its blocks, ``TokenChoiceTopKRouter``, ``RoutedExperts``/``GroupedExperts``);
    pass the ``parallelism`` it will be parallelized with (its sharding plan depends on it)."""
    return _materialize(qwen3_moe_config(**kw), seed, parallelism)


def _ends(dim: int, embedding_init: dict, norm_init: dict, head_init: dict) -> dict:
    """The token embedding, final RMSNorm and LM head configs of a model of width ``dim`` (vocab ``VOCAB``)."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return dict(tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=embedding_init),
                norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
                lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=head_init))


def deepseek_v3_config(n_layers: int = 2, dim: int = 64, experts: int = 8, top_k: int = 2, hidden: int = 32):  # noqa: ANN201
    """torchtitan's DeepSeek-V3 built by its own ``_build_dsv3_layers`` (its inits; MLA attention with a low-rank kv
    path and its ``kv_norm``, a dense first layer, then MoE layers with a shared expert), the debug model's shape made
    small: no q low-rank (as ``debugmodel``), no multi-token prediction."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _output_linear_init,
    )

    rope_dim = 8
    layers = _build_dsv3_layers(n_layers=n_layers, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0,
                                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16,
                                mscale=0.70, dense_hidden_dim=2 * dim, moe_hidden_dim=hidden, num_experts=experts,
                                num_shared_experts=1, router_top_k=top_k, router_score_func="softmax",
                                attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
                                rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=256, theta=10000.0))
    return DeepSeekV3Model.Config(vocab_size=VOCAB, dim=dim, layers=_sdpa(layers), mtp_layers=[],
                                  **_ends(dim, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init(dim)))


def deepseek_v3(seed: int = 0, parallelism=None, **kw) -> nn.Module:  # noqa: ANN001
    """torchtitan's DeepSeek-V3 (``DeepSeekV3Model``: MLA, shared + routed experts), on the CPU, weights from ``seed``;
    pass the ``parallelism`` it will be parallelized with."""
    return _materialize(deepseek_v3_config(**kw), seed, parallelism)


def llama3_config(n_layers: int = 2, dim: int = 64, n_heads: int = 4, n_kv_heads: int = 2,  # noqa: ANN201
                  hidden: int = 128):
    """torchtitan's Llama 3 built by its own ``_build_llama3_layers`` (its debugmodel's inits), made small."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    layers = _build_llama3_layers(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                  hidden_dim=hidden, attn_backend="flex",
                                  rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=256, theta=500000))
    return Llama3Model.Config(dim=dim, vocab_size=VOCAB, layers=_sdpa(layers),
                              **_ends(dim, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init(dim)))


def llama3(seed: int = 0, parallelism=None, **kw) -> nn.Module:  # noqa: ANN001
    """torchtitan's Llama 3 (``Llama3Model``: fused-qkv GQA, SwiGLU, RMSNorm), on the CPU, weights from ``seed``;
    pass the ``parallelism`` it will be parallelized with (its sharding plan is written into the config)."""
    return _materialize(llama3_config(**kw), seed, parallelism)


def routed_experts_of(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if type(m).__name__ == "RoutedExperts")


# ---- parallelism: torchtitan's own ParallelDims, parallelize_* and pipeline_llm, on gloo ----------------------


def parallelism_config(dp_shard: int = -1, tp: int = 1, pp: int = 1, ep: int = 1,  # noqa: ANN201
                       schedule: str = "1F1B"):
    """torchtitan's ``ParallelismConfig`` on the ``partial_dtensor`` backend (``spmd_types``, the default, leaves
    plain tensors, which ``fully_shard`` refuses). EP borrows its ranks from ``dp_shard`` × ``tp``."""
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(data_parallel_shard_degree=dp_shard, tensor_parallel_degree=tp,
                             pipeline_parallel_degree=pp, expert_parallel_degree=ep,
                             pipeline_parallel_schedule=schedule, spmd_backend="partial_dtensor")


def parallel_dims(world_size: int, dp_shard: int = -1, tp: int = 1, pp: int = 1, ep: int = 1):  # noqa: ANN201
    """torchtitan's ``ParallelDims`` for a gloo job, its meshes built now, on "cpu" (mesh dims: pp, batch, loss,
    dp_replicate, fsdp, cp, tp, ep, efsdp; the size-1 ones on the "fake" backend, except ``fsdp``)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
    import torchtitan.distributed.utils as du
    from torchtitan.distributed import ParallelDims

    cpu_titan()
    du.set_spmd_backend("partial_dtensor")  # torchtitan's loss reads it from there
    dims = ParallelDims.from_config(parallelism_config(dp_shard, tp, pp, ep), world_size)
    dims.build_mesh()
    return dims


def _titan_kwargs(dims, schedule: str = "1F1B", local_batch: int = 4) -> dict:  # noqa: ANN001
    """The configs torchtitan's parallelize/pipeline functions take: no mixed precision (parameters and
    reductions in float32), compile off, activation checkpointing off."""
    from torchtitan.config import CompileConfig, TrainingConfig

    return dict(parallel_dims=dims, parallelism=parallelism_config(dims.dp_shard, dims.tp, dims.pp, dims.ep, schedule),
                training=TrainingConfig(local_batch_size=local_batch, mixed_precision_param="float32"),
                compile_config=CompileConfig(enable=False), ac_config=None, dump_folder="/tmp")


def _parallelize_fn(kind: str):  # noqa: ANN202
    if kind == "llama3":
        from torchtitan.models.llama3.parallelize import parallelize_llama

        return parallelize_llama
    if kind == "deepseek_v3":
        from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

        return parallelize_deepseekv3
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    return parallelize_qwen3


def _sum_for_gloo(module: nn.Module) -> None:
    """gloo has no PREMUL_SUM: every FSDP unit reduces with SUM (torchtitan sets its divide factor to 1: the loss
    is a sum over tokens divided by the global token count, so FSDP's sum is the gradient of the global mean)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def _check_plan(model: nn.Module, dims) -> None:  # noqa: ANN001
    """Without a sharding plan, torchtitan's TP/EP silently does nothing."""
    if dims.tp_enabled or dims.ep_enabled:
        assert any(getattr(m, "_sharding_config", None) is not None for m in model.modules()), \
            "build the model with parallelism=parallelism_config(...): it has no sharding plan"


def parallelize(model: nn.Module, dims, kind: str = "llama3") -> nn.Module:  # noqa: ANN001
    """torchtitan's ``parallelize_llama`` / ``parallelize_qwen3`` / ``parallelize_deepseekv3`` ("llama3" / "qwen3" /
    "deepseek_v3"): TP when ``dims.tp`` > 1, EP
    when ``dims.ep`` > 1, and FSDP always, on the ``fsdp`` mesh even of size 1 (so every parameter becomes a
    DTensor). ``model`` must have been built with ``parallelism=`` (its sharding plan) for TP/EP."""
    _check_plan(model, dims)
    model = _parallelize_fn(kind)(model, **_titan_kwargs(dims))
    _sum_for_gloo(model)
    return model


def pipeline(model: nn.Module, dims, schedule: str = "1F1B", local_batch: int = 4,  # noqa: ANN001, ANN201
             kind: str = "llama3"):
    """torchtitan's ``pipeline_llm``: split ``model`` in ``dims.pp`` stages its way (a copy per stage, the layers
    it does not own deleted, embeddings/norm/head ``None`` where not first/last), each part parallelized by
    torchtitan's function as in ``parallelize``, and a ``schedule`` ("GPipe", "1F1B") splitting each rank's
    ``local_batch`` in microbatches of 1, whose loss is ``loss_fn``'s (give ``step`` its divisor:
    ``loss_kwargs={"global_valid_tokens": n}``). Returns ``(schedule, stage, part)`` for this rank's one stage."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    _check_plan(model, dims)
    sched, (part,), _, _ = pipeline_llm(model, **_titan_kwargs(dims, schedule, local_batch), device=torch.device("cpu"),
                                        model_config=model.config, parallelize_fn=_parallelize_fn(kind),
                                        loss_fn=loss_fn())
    _sum_for_gloo(part)
    return sched, sched._stage, part


def loss_fn():  # noqa: ANN201
    """torchtitan's ``CrossEntropyLoss``: ``loss, _ = loss_fn(pred, labels, global_valid_tokens)`` is this rank's
    summed cross-entropy over the global token count (vocab-parallel when ``pred`` is sharded on tp)."""
    from torchtitan.components.loss import CrossEntropyLoss

    return CrossEntropyLoss(CrossEntropyLoss.Config())


def grad_norm(part: nn.Module, dims) -> torch.Tensor:  # noqa: ANN001
    """The global gradient 2-norm as torchtitan's ``clip_grad_norm_`` computes it (max_norm=inf: nothing is
    clipped): per-mesh DTensor norms made whole (``full_tensor``), EP and non-EP combined, norm² summed over pp."""
    from torchtitan.distributed.utils import clip_grad_norm_

    pp_mesh = dims.get_mesh("pp") if dims.pp_enabled else None
    return clip_grad_norm_(list(part.parameters()), float("inf"), pp_mesh=pp_mesh, ep_enabled=dims.ep_enabled)
