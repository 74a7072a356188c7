"""A user's own loop, trained from initialisation with gradloc watching (issue 32's report): a
byte-level ``GPT2LMHeadModel`` (3 layers, dropout on) on the licence texts of
/usr/share/common-licenses, 4 micro-batches, a linear LR warm-up then cosine decay, clipping at 1.0.

Faults can be planted on chosen steps (one sample of one micro-batch each):

- ``token``: one target of a sample gets loss weight ``TOKEN_WEIGHT`` × the step's loss tokens
  (a high-weight token, as in an RL plant);
- ``padding``: one sample becomes a row of padding (byte 0) whose loss is left unmasked;
- ``padded_batch``: every row of one micro-batch is padded after its first quarter (short documents
  padded to the sequence length), the padding's loss unmasked;
- ``scaled``: one micro-batch's loss is weighted ``SCALED`` ×: the whole step spikes (early in
  training a planted token or padding barely moves the norm, the model predicts every byte alike).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import gradloc
from gradloc.config import DetectorConfig, SampleConfig
from gradloc.engine.monitor import StepReport

LICENSES = Path("/usr/share/common-licenses")
TOKEN_WEIGHT = 0.15  # the planted token's loss weight, as a share of the step's loss tokens
PAD = 0  # byte 0: no licence text holds a NUL
SCALED = 20.0


def licence_bytes() -> torch.Tensor:
    """Every licence text's bytes, joined by newlines: (N,) int64 ids in [0, 256)."""
    parts = [p.read_bytes() for p in sorted(LICENSES.iterdir()) if p.is_file() and not p.is_symlink()]
    return torch.tensor(list(b"\n".join(parts).replace(b"\x00", b" ")), dtype=torch.long)


@dataclass(frozen=True)
class LoopConfig:
    steps: int = 300
    micro_batches: int = 4
    batch: int = 4
    seq: int = 64
    d_model: int = 64
    n_layers: int = 3
    dropout: float = 0.1
    lr: float = 3e-3
    lr_warmup: int = 30
    clip: float = 1.0
    seed: int = 0

    def lr_at(self, step: int) -> float:
        if step < self.lr_warmup:
            return self.lr * (step + 1) / self.lr_warmup
        p = min(1.0, (step - self.lr_warmup) / max(1, self.steps - self.lr_warmup))
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train(cfg: LoopConfig, faults: dict[int, str] | None = None,
          detector: DetectorConfig | None = None, samples: bool = True) -> list[StepReport]:
    """Train ``cfg.steps`` steps with gradloc attached; every step's StepReport (``samples``: the
    per-sample findings on)."""
    import transformers as tf

    data = licence_bytes()
    torch.manual_seed(cfg.seed)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=256, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=4, n_positions=cfg.seq,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, bos_token_id=0, eos_token_id=0))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    kw: dict = {} if detector is None else {"detector": detector}
    if not samples:
        kw["samples"] = SampleConfig(enabled=False)
    mon = gradloc.watch(model, opt, job=f"real-run-{cfg.seed}", embedded=False, update_ratio="off",
                        max_overhead=None, **kw)
    gen = torch.Generator().manual_seed(cfg.seed)
    n_tokens = cfg.micro_batches * cfg.batch * cfg.seq
    reports = []
    try:
        for s in range(cfg.steps):
            starts = torch.randint(0, len(data) - cfg.seq - 1, (cfg.micro_batches * cfg.batch,), generator=gen)
            win = torch.stack([data[i : i + cfg.seq + 1] for i in starts.tolist()])  # (M*B, T+1)
            win = win.view(cfg.micro_batches, cfg.batch, cfg.seq + 1)  # (M, B, T+1)
            weights = torch.ones(cfg.micro_batches, cfg.batch, cfg.seq)  # (M, B, T)
            kind = (faults or {}).get(s)
            if kind == "token":
                weights[1, 2, cfg.seq // 2] = TOKEN_WEIGHT * n_tokens
            elif kind == "padding":
                win[2, 1, 1:] = PAD  # a row of padding after its first byte, loss unmasked
            elif kind == "scaled":
                weights[0] *= SCALED  # one micro-batch's loss weighted ×SCALED: a real spike of the whole step
            elif kind == "padded_batch":
                win[2, :, cfg.seq // 4 :] = PAD  # a micro-batch of short rows padded, loss unmasked
            elif kind is not None:
                raise ValueError(f"unknown fault {kind!r}")
            for g in opt.param_groups:
                g["lr"] = cfg.lr_at(s)

            def loss_for(i: int, mask: torch.Tensor | None = None) -> torch.Tensor:
                w = weights[i] if mask is None else weights[i] * mask
                logits = model(input_ids=win[i, :, :-1]).logits  # (B, T, V)
                tok = F.cross_entropy(logits.flatten(0, 1), win[i, :, 1:].flatten(), reduction="none")  # (B*T,)
                return (tok.view_as(w) * w).sum() / n_tokens  # (B, T) weighted

            total = torch.zeros(())
            for i in range(cfg.micro_batches):
                with mon.micro_batch(win[i, :, 1:]):
                    loss = loss_for(i)
                    loss.backward()
                total += loss.detach()
            reports.append(mon.end_step(total, probe=loss_for))
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        mon.close()
    return reports
