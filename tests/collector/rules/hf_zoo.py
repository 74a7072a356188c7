"""Tiny Hugging Face models of the families gradloc's rules must cover (built offline from configs):
GPT-2 (Conv1D, learned positions), Qwen3 (per-head q/k norms), Mixtral, Qwen3-MoE and gpt-oss
(fused experts, routers; gpt-oss transposed with biases and attention sinks)."""
from __future__ import annotations

import torch
from torch import nn

VOCAB = 256
FAMILIES = ("gpt2", "qwen3", "mixtral", "qwen3moe", "gptoss")
MOE = ("mixtral", "qwen3moe", "gptoss")


def build(name: str, seed: int = 0) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=64, use_cache=False)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                use_cache=False, bos_token_id=0, eos_token_id=0))
    if name == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16))
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    if name == "qwen3moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=48, decoder_sparse_step=1,
                                                        mlp_only_layers=[]))
    if name == "gptoss":
        return tf.GptOssForCausalLM(tf.GptOssConfig(**common, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                    layer_types=["sliding_attention", "full_attention"],
                                                    sliding_window=16))
    raise ValueError(name)


def experts_of(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
