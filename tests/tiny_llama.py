"""The tiny pre-trained Llama both Hugging Face Trainer suites fine-tune (tests/integrations/test_transformers.py
in one process, tests/integrations/distributed/hf_trainer_job.py on every DDP rank): a byte-level BPE tokenizer trained on
two of the demo's sentences, a random 2-layer ``LlamaForCausalLM`` (hidden 64) pre-trained by a plain loop
until it has memorised their cycle (a fine-tune starts from a model that knows its data, so the detector's
warm-up sees the steady state, not the first descent). Samples are ``SEQ``-token windows of the cycle whose
first ``PROMPT`` positions carry no loss (label -100, like a prompt). Built the same on every call (seeded;
one thread)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SEQ, PROMPT = 24, 8


@dataclass(frozen=True)
class World:
    tok: Any  # PreTrainedTokenizerFast
    cycle: torch.Tensor  # (P·3,) token ids of the corpus cycle, repeated
    period: int  # P
    config: Any  # LlamaConfig
    weights: dict[str, torch.Tensor]  # the pre-trained model


def pretrained(steps: int = 60) -> World:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from gradloc.demo.data import SENTENCES

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(SENTENCES[:2], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>")
    stream = tok(" ".join(SENTENCES[:2]))["input_ids"]
    cycle = torch.tensor(stream * 3)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = windows(cycle, torch.randint(0, len(stream), (8,), generator=gen))
        model(input_ids=x, labels=labels(x)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return World(tok, cycle, len(stream), config, {k: v.clone() for k, v in model.state_dict().items()})


def windows(cycle: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    return torch.stack([cycle[s:s + SEQ] for s in starts.tolist()])  # (N, SEQ)


def labels(x: torch.Tensor) -> torch.Tensor:
    lab = x.clone()
    lab[..., :PROMPT] = -100  # the "prompt" carries no loss
    return lab


def rows(w: World, n: int, plant_row: int | None = None, pos: int = 17, uid0: int = 1000) -> list[dict]:
    """``n`` training rows (input_ids, attention_mask, labels, uid = uid0 + k) of random windows of the cycle
    (seed 0); with ``plant_row``, that row's input (and label) at ``pos`` is ``Z``, a byte the corpus never
    has — a corrupted token in the data."""
    x = windows(w.cycle, torch.randint(0, w.period, (n,), generator=torch.Generator().manual_seed(0)))
    if plant_row is not None:
        x[plant_row, pos] = w.tok.convert_tokens_to_ids("Z")
    return [dict(input_ids=x[i], attention_mask=torch.ones(SEQ, dtype=torch.long), labels=labels(x[i]),
                 uid=uid0 + i) for i in range(n)]


def causal_lm(w: World) -> Any:
    """A fresh ``LlamaForCausalLM`` holding the pre-trained weights."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(w.config)
    model.load_state_dict(w.weights)
    return model


__all__ = ["PROMPT", "SEQ", "World", "causal_lm", "labels", "pretrained", "rows", "windows"]
