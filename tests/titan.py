"""torchtitan 0.3.0's own models, built small on the CPU (the test extra; ``HAS_TITAN`` says whether it is here).

torchtitan's model configs are built by its own builders (``_build_qwen3_moe_layers``, …) with smaller
dimensions than its debug flavours (``debugmodel_moe`` holds 300 M parameters of experts: too large for a
2-core test), and with the three CPU workarounds of DESIGN.md §8 where they matter: attention swapped to
``ScaledDotProductAttention`` (flex attention has no CPU backward), ``device_type = "cpu"`` in
torchtitan's modules before any mesh is built (``cpu_titan``), and FSDP told to sum (gloo has no
PREMUL_SUM). Everything else is torchtitan's code: its blocks, router, token dispatcher, grouped experts.
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


def _materialize(cfg, seed: int) -> nn.Module:  # noqa: ANN001
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


def qwen3_moe(seed: int = 0, **kw) -> nn.Module:
    """torchtitan's Qwen3-MoE (its blocks, ``TokenChoiceTopKRouter``, ``RoutedExperts``/``GroupedExperts``)."""
    return _materialize(qwen3_moe_config(**kw), seed)


def routed_experts_of(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if type(m).__name__ == "RoutedExperts")
