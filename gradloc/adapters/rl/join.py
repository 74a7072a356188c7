"""vLLM rollouts → the training layout, duck-typed (no vllm import).

Input: ``RequestOutput``-like objects — ``request_id``, ``prompt_token_ids`` and ``outputs``, each
a ``CompletionOutput``-like object with ``index``, ``token_ids``, ``logprobs`` (one
``{token_id: Logprob}`` dict per generated token, from ``SamplingParams(logprobs=k)``; the sampled
token is always in it) and ``finish_reason``. vLLM 0.32 facts: ``n > 1`` completions are one
RequestOutput's ``outputs`` (``index`` 0 … n−1); an EOS that stopped a completion is its last token
and has a logprob; ``text`` drops it, so the token ids are the truth.

Output (:class:`Rollouts`): one row per completion, sequence = prompt + completion, right-padded.
Positions are *loss positions*: position p's logits score token p + 1, so ``targets`` is the
sequence shifted left, and the response is scored at [P − 1, P − 1 + R) for a prompt of P and a
completion of R tokens. ``rollout_logp`` holds the engine's log-prob of each target there.

Bad input is never silently misaligned: an empty prompt or completion, missing logprobs, a logprob
dict without the sampled token, a logprob list shorter or longer than the tokens, ids outside the
vocabulary, a sequence over ``max_length`` — each raises :class:`RolloutError` naming the request
and completion, or with ``errors="skip"`` drops that completion and lists it in ``skipped``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch

from gradloc.errors import BatchMetadataError
from gradloc.records import SampleInfo


class RolloutError(BatchMetadataError):
    """Rollouts that cannot be turned into a training layout without misaligning tokens."""


@dataclass(frozen=True)
class Skipped:
    request_id: str
    completion_index: int
    reason: str


@dataclass(frozen=True)
class Rollouts:
    """One row per completion (padded (S, L)); see the module docstring for the layout."""

    input_ids: torch.Tensor  # (S, L) long: prompt + completion, right-padded with pad_id
    attention_mask: torch.Tensor  # (S, L) bool
    targets: torch.Tensor  # (S, L) long: the token each position's logits score (pad where none)
    loss_mask: torch.Tensor  # (S, L) bool: positions scoring a response token
    rollout_logp: torch.Tensor  # (S, L) float32: the engine's log-prob of the target (NaN outside the mask)
    sample_ids: tuple[str, ...]
    infos: tuple[SampleInfo, ...]
    groups: torch.Tensor  # (S,) long: rows of one prompt share a group (GRPO's advantage groups)
    skipped: tuple[Skipped, ...] = ()

    @property
    def lengths(self) -> list[int]:
        return [i.prompt_tokens + i.response_tokens for i in self.infos]

    def rows(self, index: Sequence[int] | slice) -> "Rollouts":
        """A subset of rows (a micro-batch), trimmed to its longest sequence."""
        idx = list(range(len(self.sample_ids)))[index] if isinstance(index, slice) else list(index)
        L = max(self.lengths[i] for i in idx)
        t = torch.tensor(idx, dtype=torch.long)
        return replace(self, input_ids=self.input_ids[t, :L], attention_mask=self.attention_mask[t, :L],
                       targets=self.targets[t, :L], loss_mask=self.loss_mask[t, :L],
                       rollout_logp=self.rollout_logp[t, :L], sample_ids=tuple(self.sample_ids[i] for i in idx),
                       infos=tuple(self.infos[i] for i in idx), groups=self.groups[t], skipped=())

    def packed(self) -> "PackedRollouts":
        """The same rows as one packed row (1, N): no padding, positions restart per sequence."""
        parts = {k: [] for k in ("input_ids", "targets", "loss_mask", "rollout_logp", "position_ids")}
        for i, n in enumerate(self.lengths):
            for k in ("input_ids", "targets", "loss_mask", "rollout_logp"):
                parts[k].append(getattr(self, k)[i, :n])
            parts["position_ids"].append(torch.arange(n))
        cu = torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()], dtype=torch.long)
        cat = {k: torch.cat(v)[None] for k, v in parts.items()}  # (n_i,) each -> (1, N)
        return PackedRollouts(cat["input_ids"], cat["targets"], cat["loss_mask"], cat["rollout_logp"],
                              cat["position_ids"], cu, self.sample_ids, self.infos, self.groups)

    def micro_batch_kwargs(self) -> dict[str, Any]:
        """What ``mon.micro_batch(**...)`` takes for these rows."""
        return {"token_ids": self.targets, "loss_mask": self.loss_mask, "sample_ids": self.sample_ids,
                "sample_infos": self.infos}

    def verify(self, input_ids: torch.Tensor) -> None:
        """Raise :class:`RolloutError` unless the trainer's (S, L') sequences equal these (padding aside)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != len(self.sample_ids):
            raise RolloutError(f"the trainer has {tuple(input_ids.shape)} sequences, the rollouts {len(self.sample_ids)} rows")
        for i, n in enumerate(self.lengths):
            got, want = input_ids[i, :n].cpu(), self.input_ids[i, :n]
            if n > input_ids.shape[1] or not torch.equal(got, want):
                bad = int((got != want[: got.numel()]).nonzero()[0]) if got.numel() else 0
                raise RolloutError(f"row {i} ({self.sample_ids[i]}): the trainer's token ids differ from the "
                                   f"rollout's at position {bad}")


@dataclass(frozen=True)
class PackedRollouts:
    input_ids: torch.Tensor  # (1, N)
    targets: torch.Tensor  # (1, N)
    loss_mask: torch.Tensor  # (1, N): the last position of each sequence scores nothing
    rollout_logp: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N), restarting at 0 per sequence
    cu_seqlens: torch.Tensor  # (S + 1,)
    sample_ids: tuple[str, ...]
    infos: tuple[SampleInfo, ...]
    groups: torch.Tensor

    def micro_batch_kwargs(self) -> dict[str, Any]:
        return {"token_ids": self.targets, "loss_mask": self.loss_mask, "sample_ids": self.sample_ids,
                "sample_infos": self.infos, "cu_seqlens": self.cu_seqlens}


def join(outputs: Iterable[Any], *, pad_id: int = 0, uid: Callable[[Any, Any], str] | None = None,
         vocab_size: int | None = None, max_length: int | None = None, errors: str = "raise") -> Rollouts:
    """Rows of prompt + completion for every completion of every request output (see the module)."""
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors must be 'raise' or 'skip', got {errors!r}")
    rows, skipped = [], []
    for group, out in enumerate(outputs):
        rid = str(getattr(out, "request_id", group))
        for c in getattr(out, "outputs", ()):
            index = int(getattr(c, "index", len(rows)))
            try:
                rows.append((group, _row(out, c, rid, index, uid, vocab_size, max_length)))
            except RolloutError as exc:
                if errors == "raise":
                    raise
                skipped.append(Skipped(rid, index, str(exc)))
    if not rows:
        raise RolloutError("no usable completion in the rollouts" + (f" ({len(skipped)} skipped)" if skipped else ""))
    return _stack(rows, pad_id, tuple(skipped))


def _row(out: Any, c: Any, rid: str, index: int, uid: Callable[[Any, Any], str] | None,
         vocab_size: int | None, max_length: int | None) -> tuple[list[int], list[float], str, SampleInfo]:
    where = f"request {rid!r} completion {index}"
    prompt = [int(t) for t in (getattr(out, "prompt_token_ids", None) or [])]
    tokens = [int(t) for t in (getattr(c, "token_ids", None) or [])]
    if not prompt:
        raise RolloutError(f"{where}: empty prompt_token_ids (the first response token needs a position to be scored from)")
    if not tokens:
        raise RolloutError(f"{where}: empty completion")
    lps = getattr(c, "logprobs", None)
    if lps is None:
        raise RolloutError(f"{where}: no logprobs (generate with SamplingParams(logprobs=0) or more)")
    if len(lps) != len(tokens):
        raise RolloutError(f"{where}: {len(lps)} logprob entries for {len(tokens)} tokens (truncated output?)")
    logp = []
    for k, (tok, d) in enumerate(zip(tokens, lps)):
        entry = d.get(tok) if hasattr(d, "get") else None
        if entry is None:
            raise RolloutError(f"{where}: the logprobs of token {k} do not hold the sampled token {tok}")
        value = float(getattr(entry, "logprob", entry))
        if not math.isfinite(value):
            raise RolloutError(f"{where}: the sampled token {k}'s logprob is {value}")
        logp.append(value)
    seq = prompt + tokens
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in seq):
        raise RolloutError(f"{where}: token ids outside the vocabulary of {vocab_size}")
    if max_length is not None and len(seq) > max_length:
        raise RolloutError(f"{where}: {len(seq)} tokens, over max_length {max_length}")
    info = SampleInfo(rid, index, len(prompt), len(prompt) - 1, len(tokens), getattr(c, "finish_reason", None))
    return seq, logp, uid(out, c) if uid is not None else f"{rid}#{index}", info


def _stack(rows: list[tuple[int, tuple[list[int], list[float], str, SampleInfo]]], pad_id: int,
           skipped: tuple[Skipped, ...]) -> Rollouts:
    S, L = len(rows), max(len(r[1][0]) for r in rows)
    input_ids = torch.full((S, L), pad_id, dtype=torch.long)
    targets = torch.full((S, L), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(S, L, dtype=torch.bool)
    attention = torch.zeros(S, L, dtype=torch.bool)
    rollout_logp = torch.full((S, L), math.nan, dtype=torch.float32)
    for i, (_, (seq, logp, _, info)) in enumerate(rows):
        n, a = len(seq), info.response_start
        input_ids[i, :n] = torch.tensor(seq)
        attention[i, :n] = True
        targets[i, : n - 1] = input_ids[i, 1:n]
        loss_mask[i, a:a + info.response_tokens] = True
        rollout_logp[i, a:a + info.response_tokens] = torch.tensor(logp)
    groups = torch.tensor([g for g, _ in rows], dtype=torch.long)
    return Rollouts(input_ids, attention, targets, loss_mask, rollout_logp, tuple(r[1][2] for r in rows),
                    tuple(r[1][3] for r in rows), groups, skipped)
