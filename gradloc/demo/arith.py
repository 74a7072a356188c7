"""The RL demo's verifiable task: single-digit arithmetic, with a character-level tokenizer.

A prompt is ``<bos>a∘b=`` with digits a, b and ∘ one of ``+ - *``; the answer is the result's
digits followed by ``<eos>`` (rendered ``.``), e.g. ``7*8=`` → ``56.``. The reward checks the
completion against the exact answer. The tokenizer is a fixed table of 17 characters (no download),
so incidents render the rollout's text as it reads: ``…3+4=[[8]].…``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAD, BOS, EOS = 0, 1, 2
CHARS = ("", "", ".", *"0123456789", "+", "-", "*", "=")  # pad and bos render as nothing, eos as "."
VOCAB = len(CHARS)
OPS = "+-*"
PROMPT_TOKENS = 5  # <bos> a ∘ b =
MAX_ANSWER = 3  # at most two characters (81, -9) and <eos>
SAMPLED = tuple(range(EOS, VOCAB))  # what a completion may contain: not pad or <bos> (vLLM's allowed_token_ids)
_ID = {c: i for i, c in enumerate(CHARS) if c}


def encode(text: str) -> list[int]:
    """Characters -> ids (no <bos>/<eos>: add them explicitly)."""
    return [_ID[c] for c in text]


def to_text(ids: list[int]) -> str:
    """Ids -> text; pad and <bos> render as nothing, <eos> as ``.``, unknown ids as ``?``."""
    return "".join(CHARS[i] if 0 <= i < VOCAB else "?" for i in ids)


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def prompt_ids(self) -> list[int]:
        return [BOS, *encode(f"{self.a}{self.op}{self.b}=")]

    @property
    def answer(self) -> str:
        value = self.a + self.b if self.op == "+" else self.a - self.b if self.op == "-" else self.a * self.b
        return str(value)

    @property
    def answer_ids(self) -> list[int]:
        return [*encode(self.answer), EOS]

    def reward(self, completion: list[int]) -> float:
        """1 for exactly the answer and <eos>, else 0."""
        return float(list(completion) == self.answer_ids)


def problems(gen: torch.Generator, n: int) -> list[Problem]:
    """``n`` problems drawn uniformly (digits 0–9, one of ``+ - *``)."""
    digits = torch.randint(0, 10, (n, 2), generator=gen).tolist()  # (n, 2): a, b
    ops = torch.randint(0, len(OPS), (n,), generator=gen).tolist()
    return [Problem(a, OPS[o], b) for (a, b), o in zip(digits, ops)]


def sft_batch(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Supervised rows prompt + answer: (inputs, targets, loss mask), each (n, L) with L =
    PROMPT_TOKENS + MAX_ANSWER − 1; the mask covers the answer's tokens (the loss positions scoring them)."""
    L = PROMPT_TOKENS + MAX_ANSWER
    seqs = torch.full((n, L), PAD, dtype=torch.long)
    mask = torch.zeros(n, L - 1, dtype=torch.bool)
    for i, p in enumerate(problems(gen, n)):
        ids = p.prompt_ids + p.answer_ids
        seqs[i, : len(ids)] = torch.tensor(ids)
        mask[i, PROMPT_TOKENS - 1: len(ids) - 1] = True
    return seqs[:, :-1], seqs[:, 1:], mask  # (n, L) -> (n, L − 1) inputs and shifted targets
