"""The models the overhead benchmark runs: the demo TinyGPT, a random-initialized HF Llama and, with
``--model qwen3moe`` or ``all``, a random-initialized HF Qwen3-MoE (fused experts, top-k routers).

Both are built offline from a seed (no download) and trained on uniformly random token ids with
the same per-token cross-entropy (``gradloc.demo.model.token_losses``) on their (B, T, V) logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gradloc.demo.model import GPTConfig, TinyGPT

MODELS = ("tinygpt", "llama")  # the default run
ALL_MODELS = (*MODELS, "qwen3moe")


@dataclass(frozen=True)
class ModelConfig:
    kind: str  # "tinygpt" | "llama"
    micro_batches: int
    batch: int
    seq: int
    d_model: int
    n_layers: int
    n_heads: int
    vocab: int
    kv_heads: int | None = None  # llama: grouped-query attention's key/value heads
    ffn: int | None = None  # llama: the SwiGLU MLP's intermediate size; qwen3moe: each expert's
    experts: int | None = None  # qwen3moe: experts per layer
    top_k: int | None = None  # qwen3moe: experts per token
    rounds: int = 40  # measured rounds by default (``--rounds`` overrides every model's)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.batch * self.seq

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {"model": self.kind, "micro_batches": self.micro_batches, "batch": self.batch,
                                  "seq": self.seq, "d_model": self.d_model, "n_layers": self.n_layers,
                                  "n_heads": self.n_heads, "vocab": self.vocab}
        if self.kind in ("llama", "qwen3moe"):
            out.update(kv_heads=self.kv_heads, ffn=self.ffn, tied_embeddings=True)
        if self.kind == "qwen3moe":
            out.update(experts=self.experts, top_k=self.top_k)
        return out


# The TinyGPT of every earlier overhead measurement (docs/BENCHMARKS.md §1): 5.3 M parameters.
TINYGPT = ModelConfig("tinygpt", micro_batches=2, batch=4, seq=256, d_model=256, n_layers=4, n_heads=8, vocab=4096)
# Llama-shaped: RMSNorm, rotary positions, SwiGLU with 1408 ≈ 2.75 × 512 (Llama's 8/3·d rounded up
# to a multiple of 64), 8 query heads sharing 2 key/value heads, tied embeddings; 19.0 M parameters.
# About 4 s per step on one thread here: 20 rounds keep `--model all` near 10 minutes.
LLAMA = ModelConfig("llama", micro_batches=2, batch=4, seq=256, d_model=512, n_layers=6, n_heads=8, vocab=4096,
                    kv_heads=2, ffn=1408, rounds=20)
# Qwen3-MoE-shaped: the Llama's attention and width, 8 SwiGLU experts of 176 per layer and 2 per token
# (Qwen3-30B-A3B's 128 of 768 and 8, scaled), top-k routers, per-head q/k norms, tied embeddings;
# 19.0 M parameters, as many as the Llama.
QWEN3MOE = ModelConfig("qwen3moe", micro_batches=2, batch=4, seq=256, d_model=512, n_layers=6, n_heads=8, vocab=4096,
                       kv_heads=2, ffn=176, experts=8, top_k=2, rounds=20)
QUICK = {
    "tinygpt": ModelConfig("tinygpt", micro_batches=1, batch=2, seq=64, d_model=64, n_layers=2, n_heads=4,
                           vocab=512, rounds=10),
    "llama": ModelConfig("llama", micro_batches=1, batch=2, seq=64, d_model=64, n_layers=2, n_heads=4, vocab=512,
                         kv_heads=2, ffn=176, rounds=10),
    "qwen3moe": ModelConfig("qwen3moe", micro_batches=1, batch=2, seq=64, d_model=64, n_layers=2, n_heads=4,
                            vocab=512, kv_heads=2, ffn=48, experts=4, top_k=2, rounds=10),
}
FULL = {"tinygpt": TINYGPT, "llama": LLAMA, "qwen3moe": QWEN3MOE}


def model_config(kind: str, quick: bool) -> ModelConfig:
    return (QUICK if quick else FULL)[kind]


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The seeded model every variant starts from (each variant gets a deep copy)."""
    torch.manual_seed(seed)
    if cfg.kind == "tinygpt":
        return TinyGPT(GPTConfig(vocab=cfg.vocab, seq=cfg.seq, d_model=cfg.d_model, n_layers=cfg.n_layers,
                                 n_heads=cfg.n_heads))
    if cfg.kind == "qwen3moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(vocab_size=cfg.vocab, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
                                num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                                head_dim=cfg.d_model // cfg.n_heads, moe_intermediate_size=cfg.ffn,
                                num_experts=cfg.experts, num_experts_per_tok=cfg.top_k, decoder_sparse_step=1,
                                mlp_only_layers=[], max_position_embeddings=cfg.seq, tie_word_embeddings=True,
                                use_cache=False)
        return Qwen3MoeForCausalLM(config)
    LlamaConfig, LlamaForCausalLM = _import_llama()
    config = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.d_model, intermediate_size=cfg.ffn,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq,
                         tie_word_embeddings=True, use_cache=False)
    model = LlamaForCausalLM(config)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("LlamaForCausalLM did not tie its input and output embeddings")
    return model


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, T) token ids -> (B, T, V) logits, for either kind of model."""
    out = model(x)  # TinyGPT: a tensor; LlamaForCausalLM (input_ids first): CausalLMOutputWithPast
    return out if isinstance(out, torch.Tensor) else out.logits


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once


def _import_llama() -> tuple[type, type]:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig, LlamaForCausalLM
