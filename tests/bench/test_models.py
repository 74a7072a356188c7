"""The benchmark's models: TinyGPT as before, and a Llama with the shape the docs state."""
from __future__ import annotations

import pytest
import torch

from bench.models import FULL, QUICK, build_model, logits, param_bytes
from tests.helpers import single_thread  # noqa: F401 (autouse fixture)


def test_full_llama_config_is_llama_shaped():
    c = FULL["llama"]
    assert c.d_model >= 512 and c.n_layers >= 6 and c.kv_heads < c.n_heads
    assert 2.5 <= c.ffn / c.d_model <= 4.0 and 1000 <= c.vocab <= 10000


def test_quick_llama_builds_tied_gqa_rotary_and_gives_logits():
    pytest.importorskip("transformers")
    cfg = QUICK["llama"]
    model = build_model(cfg, seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.out_features * cfg.n_heads == attn.q_proj.out_features * cfg.kv_heads  # GQA
    assert hasattr(model.model, "rotary_emb")
    x = torch.randint(cfg.vocab, (2, cfg.seq))
    assert logits(model, x).shape == (2, cfg.seq, cfg.vocab)
    assert param_bytes(model) == 4 * sum(p.numel() for p in model.parameters())
    again = build_model(cfg, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded


def test_qwen3moe_builds_fused_experts_and_routers_and_its_stated_size():
    pytest.importorskip("transformers")
    quick = build_model(QUICK["qwen3moe"], seed=0)
    experts = [m for m in quick.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    assert len(experts) == QUICK["qwen3moe"].n_layers and experts[0].gate_up_proj.dim() == 3
    x = torch.randint(QUICK["qwen3moe"].vocab, (2, QUICK["qwen3moe"].seq))
    assert logits(quick, x).shape == (2, QUICK["qwen3moe"].seq, QUICK["qwen3moe"].vocab)
    full = build_model(FULL["qwen3moe"], seed=0)
    assert 18.95e6 < sum(p.numel() for p in full.parameters()) < 19.05e6  # "19.0 M parameters" (bench/models.py)
