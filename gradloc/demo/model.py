"""A small GPT (nanoGPT-shaped) used by the demo, the benchmarks and the tests."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradloc.errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    seq: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    norm: str = "layer"  # "layer" | "rms"

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.norm not in ("layer", "rms"):
            raise ConfigError(f"norm must be 'layer' or 'rms', got {self.norm!r}")
        if min(self.vocab, self.seq, self.d_model, self.n_layers) < 1 or not 0 <= self.dropout < 1:
            raise ConfigError(f"invalid GPTConfig {self}")


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.LayerNorm(cfg.d_model) if cfg.norm == "layer" else nn.RMSNorm(cfg.d_model)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln1, self.ln2 = _norm(cfg), _norm(cfg)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, D = x.shape
        H = self.cfg.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)  # (B, T, 3D) -> 3 × (B, T, D)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D/H)
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        y = y.transpose(1, 2).reshape(B, T, D)  # (B, H, T, D/H) -> (B, T, D)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = _norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V). With ``cu_seqlens`` (S + 1 offsets), ``idx`` is one packed row (1, N) of
        S sequences: positions restart at each sequence and attention stays inside it."""
        B, T = idx.shape
        mask = None
        if cu_seqlens is None:
            pos = torch.arange(T, device=idx.device).expand(B, T)  # (T,) -> (B, T): per-token positions
        else:
            lengths = torch.diff(cu_seqlens)  # (S,)
            seg = torch.repeat_interleave(torch.arange(len(lengths), device=idx.device), lengths)  # (N,)
            pos = (torch.arange(T, device=idx.device) - cu_seqlens[seg])[None]  # (N,) -> (1, N)
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            mask = causal & (seg[:, None] == seg[None, :])  # (N, N): block-diagonal causal
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        return self.head(self.ln_f(x))  # (B, T, V)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy, (B, T, V) × (B, T) -> (B, T)."""
    B, T, V = logits.shape
    return F.cross_entropy(logits.reshape(B * T, V).float(), targets.reshape(B * T), reduction="none").view(B, T)
