"""Tiny HF causal LMs pre-trained from scratch on natural text, offline, with gradloc attached.

The reusable setup of the healthy-run benchmark (``bench/healthy.py``) and of fault scenarios:

- :func:`natural_corpus`: natural English text that exists on every machine without a download: the
  docstrings of Python's standard library (module, class and function docstrings of >= 80
  characters, parsed with ``ast``, never imported) and, where present, Debian's license texts in
  ``/usr/share/common-licenses``; tokenized with a byte-level BPE (``tokenizers``) trained on that
  text at run time (deterministic; ~1 s). Documents are joined with an end-of-text token into
  one stream; a sample is a random window of ``seq + 1`` ids.
- :func:`build_model`: a model family (:data:`FAMILIES`: Qwen2, GPT-NeoX, Llama, GPT-2, Qwen3, Qwen3-MoE) built from a
  small transformers config, random initialisation, no dropout; its ``forward(ids)`` returns logits.
- :class:`Run`: AdamW (β = 0.9, 0.95, weight decay 0.1), a linear LR warm-up then cosine decay to
  10%, clipping at 1.0, gradloc watching (``end_step`` before clipping, with the probe closure). The
  data of step ``s`` depends only on (seed, s), so a run with an injected fault sees exactly the
  healthy run's data apart from the faulty sample.
- ``natural_faults.inject``: turns one sample of a step into a fault (``natural_faults.FAULTS``).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("qwen2", "gptneox", "llama", "gpt2", "qwen3", "qwen3moe")
LICENSES = Path("/usr/share/common-licenses")
EOS = "<|endoftext|>"
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


# -- corpus -----------------------------------------------------------------------------------------
def stdlib_docstrings(min_chars: int = 80) -> list[str]:
    """Module, class and function docstrings of the standard library's sources (never imported)."""
    root = sysconfig.get_paths()["stdlib"]
    docs: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(dirpath, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= min_chars:
                        docs.append(doc)
    return docs


def license_texts() -> list[str]:
    if not LICENSES.is_dir():
        return []
    out = []
    for p in sorted(LICENSES.iterdir()):
        if p.is_file() and not p.is_symlink():
            try:
                out.append(p.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
    return out


@dataclass
class NaturalCorpus:
    ids: torch.Tensor  # (N,) int64: every document's ids, each followed by the end-of-text id
    vocab: int
    eos: int
    tokenizer: Any  # tokenizers.Tokenizer
    documents: int
    chars: int
    sha256: str  # of the text (documents joined): which corpus a result was measured on

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def to_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def windows(self, gen: torch.Generator, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` random windows of ``length`` ids: ((n, length) ids, (n,) start offsets)."""
        starts = torch.randint(0, len(self.ids) - length, (n,), generator=gen)
        return torch.stack([self.ids[s : s + length] for s in starts.tolist()]), starts

    def info(self) -> dict[str, Any]:
        return {"documents": self.documents, "chars": self.chars, "tokens": len(self.ids), "vocab": self.vocab,
                "sha256": self.sha256[:16], "sources": ["python stdlib docstrings"]
                + (["/usr/share/common-licenses"] if LICENSES.is_dir() else [])}


@functools.lru_cache(maxsize=4)
def natural_corpus(vocab: int = 2048) -> NaturalCorpus:
    """The corpus and its byte-level BPE of ``vocab`` ids (cached per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = stdlib_docstrings() + license_texts()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids += enc.ids + [eos]
    sha = hashlib.sha256("\x00".join(docs).encode()).hexdigest()
    return NaturalCorpus(torch.tensor(ids, dtype=torch.long), tok.get_vocab_size(), eos, tok, len(docs),
                         sum(map(len, docs)), sha)


# -- models -----------------------------------------------------------------------------------------
class CausalLM(nn.Module):
    """A transformers causal LM whose ``forward(ids)`` returns the logits (B, T, V)."""

    def __init__(self, hf: nn.Module, family: str) -> None:
        super().__init__()
        self.hf, self.family = hf, family

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.hf(input_ids=ids)
        self.aux_loss = getattr(out, "aux_loss", None)  # a MoE's load-balancing loss (output_router_logits)
        self.router_logits = getattr(out, "router_logits", None)  # a MoE's per-layer router logits, (B·T, E) each
        return out.logits


def build_model(family: str, vocab: int, seq: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                seed: int = 0, experts: int = 8, top_k: int = 2, tied: bool | None = None) -> CausalLM:
    """A small ``family`` model (random initialisation seeded with ``seed``; no dropout). ``experts``/``top_k``: a
    Qwen3-MoE's experts per layer and per token; ``tied``: whether the output head shares the input embedding (None:
    the family's own choice below)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                  max_position_embeddings=seq, bos_token_id=0, eos_token_id=0)
    if family == "qwen2":
        cfg = tf.Qwen2Config(**common, intermediate_size=3 * d_model, num_key_value_heads=max(1, n_heads // 2),
                             tie_word_embeddings=True if tied is None else tied)
        cls = tf.Qwen2ForCausalLM
    elif family == "gptneox":  # Pythia-style: parallel residual, partial rotary, untied head
        cfg = tf.GPTNeoXConfig(**common, intermediate_size=4 * d_model, rotary_pct=0.25, use_parallel_residual=True,
                               tie_word_embeddings=bool(tied))
        cls = tf.GPTNeoXForCausalLM
    elif family == "llama":
        cfg = tf.LlamaConfig(**common, intermediate_size=3 * d_model, num_key_value_heads=max(1, n_heads // 2),
                             tie_word_embeddings=True if tied is None else tied)
        cls = tf.LlamaForCausalLM
    elif family == "qwen3":  # Llama-like with qk-norm (RMSNorm on q and k per head): the attention-logit control
        cfg = tf.Qwen3Config(**common, intermediate_size=3 * d_model, num_key_value_heads=max(1, n_heads // 2),
                             head_dim=d_model // n_heads, tie_word_embeddings=True if tied is None else tied)
        cls = tf.Qwen3ForCausalLM
    elif family == "qwen3moe":  # every layer sparse; the load-balancing loss is the caller's to add
        cfg = tf.Qwen3MoeConfig(**common, num_key_value_heads=max(1, n_heads // 2), head_dim=d_model // n_heads,
                                num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=d_model,
                                decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=True,
                                tie_word_embeddings=True if tied is None else tied)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=d_model, n_layer=n_layers, n_head=n_heads, n_positions=seq,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        cls = tf.GPT2LMHeadModel
    else:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    torch.manual_seed(seed)
    model = cls(cfg)
    model.train()
    return CausalLM(model, family)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy, (B, T, V) × (B, T) -> (B, T)."""
    B, T, V = logits.shape
    return F.cross_entropy(logits.reshape(B * T, V).float(), targets.reshape(B * T), reduction="none").view(B, T)


# -- a training run ---------------------------------------------------------------------------------
@dataclass
class StepBatch:
    """One optimizer step's data: ``windows`` (M, B, T + 1) ids, per-token loss ``weights`` (M, B, T)."""

    windows: torch.Tensor
    weights: torch.Tensor
    sample_ids: list[list[str]]
    label_override: dict[tuple[int, int, int], int] = field(default_factory=dict)
    shifted: set[tuple[int, int]] = field(default_factory=set)

    def inputs(self, mb: int) -> torch.Tensor:
        return self.windows[mb, :, :-1]

    def targets(self, mb: int) -> torch.Tensor:
        y = self.windows[mb, :, 1:].clone()
        for (m, b, t), tok in self.label_override.items():
            if m == mb:
                y[b, t] = tok
        for m, b in self.shifted:
            if m == mb:
                y[b] = self.windows[mb, b, :-1]
        return y


@dataclass(frozen=True)
class RunConfig:
    family: str = "qwen2"
    seed: int = 0
    steps: int = 2000
    micro_batches: int = 2
    batch: int = 4
    seq: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab: int = 2048
    lr: float = 3e-3
    lr_warmup: int = 100  # linear LR warm-up steps, then cosine to min_lr_ratio × lr at `steps`
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    experts: int = 8  # qwen3moe: experts per layer
    top_k: int = 2  # qwen3moe: experts per token
    tied: bool | None = None  # the output head shares the input embedding (None: the family's choice)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if min(self.steps, self.micro_batches, self.batch, self.seq) < 1:
            raise ValueError("steps, micro_batches, batch and seq must be >= 1")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in [1, experts={self.experts}], got {self.top_k}")

    def lr_at(self, step: int) -> float:
        if step < self.lr_warmup:
            return self.lr * (step + 1) / self.lr_warmup
        p = min(1.0, (step - self.lr_warmup) / max(1, self.steps - self.lr_warmup))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


class Watched:
    """What a watched bench run shares (``mon``, ``model``, ``opt``, ``cfg.clip``, ``step_no``): the end of a step —
    gradloc's ``end_step`` with the probe, clipping, the update — and closing."""

    mon: Any
    model: nn.Module
    opt: torch.optim.Optimizer
    step_no: int

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def finish(self, total: torch.Tensor, probe: Callable[..., torch.Tensor]) -> Any:
        """``end_step`` (the StepReport it returns), clipping at ``cfg.clip``, the optimizer step."""
        report = self.mon.end_step(total, probe=probe)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)  # type: ignore[attr-defined]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1
        return report

    def close(self) -> None:
        self.mon.close()


class Run(Watched):
    """One model trained on the natural corpus with gradloc attached (``watch``: WatchConfig fields)."""

    def __init__(self, cfg: RunConfig, wrap: Callable[[nn.Module], nn.Module] | None = None, **watch: Any) -> None:
        """``wrap``: the model as training holds it (e.g. ``DistributedDataParallel``), watched as it is."""
        import gradloc

        self.cfg = cfg
        self.corpus = natural_corpus(cfg.vocab)
        self.model = build_model(cfg.family, self.corpus.vocab, cfg.seq, cfg.d_model, cfg.n_layers, cfg.n_heads,
                                 seed=cfg.seed, experts=cfg.experts, top_k=cfg.top_k, tied=cfg.tied)
        if wrap is not None:
            self.model = wrap(self.model)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        kw = {"job": f"natural-{cfg.family}-{cfg.seed}", "embedded": False, "update_ratio": "off",
              "max_overhead": None, **watch}  # no shedding: what the detector sees must not depend on timing
        self.mon = gradloc.watch(self.model, self.opt, **kw)
        self.step_no = 0

    def batch(self, step: int) -> StepBatch:
        """Step ``step``'s data: the same for every run of this seed, whatever happened before."""
        c = self.cfg
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + step)
        w, _ = self.corpus.windows(gen, c.micro_batches * c.batch, c.seq + 1)
        ids = [[f"s{step}-{m}-{b}" for b in range(c.batch)] for m in range(c.micro_batches)]
        return StepBatch(w.view(c.micro_batches, c.batch, c.seq + 1).clone(),
                         torch.ones(c.micro_batches, c.batch, c.seq), ids)

    def closure(self, batch: StepBatch) -> Callable[..., torch.Tensor]:
        n = batch.weights.numel()

        def loss_for(i: int, mask: torch.Tensor | None = None) -> torch.Tensor:
            w = batch.weights[i] if mask is None else batch.weights[i] * mask
            return (token_losses(self.model(batch.inputs(i)), batch.targets(i)) * w).sum() / n

        return loss_for

    def step(self, batch: StepBatch | None = None) -> Any:
        """Train one step on ``batch`` (default: this step's healthy data); gradloc's StepReport."""
        batch = batch if batch is not None else self.batch(self.step_no)
        for g in self.opt.param_groups:
            g["lr"] = self.cfg.lr_at(self.step_no)
        loss_for = self.closure(batch)
        total = torch.zeros(())
        for i in range(batch.windows.shape[0]):
            with self.mon.micro_batch(batch.targets(i), sample_ids=batch.sample_ids[i]):
                loss = loss_for(i)
                loss.backward()
            total += loss.detach()
        return self.finish(total, loss_for)
