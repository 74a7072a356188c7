"""OpenRLHF experiences → gradloc's layout, duck-typed (no openrlhf, deepspeed or ray import).

An OpenRLHF 0.11 ``Experience`` holds ``sequences`` and ``attention_mask`` (B, T) — prompt + response,
right-padded by ``make_experience_batch`` — and per-action tensors (B, A): ``action_mask``,
``action_log_probs`` (the policy that sampled, as the trainer scored it: π_old),
``base_action_log_probs`` (reference), ``rollout_log_probs`` (the inference engine's, present when
its IS correction is on), ``advantages``. The actor computes log-probs of the rolled sequences,
drops the last column and keeps the last A: action j is scored at logits position T − 1 − A + j and
is token T − A + j. OpenRLHF 0.11 builds ``action_mask = mask[1:T]``, so A = T − 1 and action j ↔
token j + 1, scored at position j.

gradloc's layout is the logits' (B, T): position p scores token p + 1, so ``token_ids`` =
``sequences[:, 1:]`` (and pad at the last column, which scores nothing) and ``loss_mask`` = the action
mask at its positions. With ``packing_samples`` the actor packs the attended tokens of every row into
one (1, N) row, positions restarting per row; :func:`layout` then packs the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gradloc.errors import BatchMetadataError
from gradloc.integrations.jagged import describe, micro_batch_kwargs
from gradloc.integrations.provenance import with_row_provenance
from gradloc.records import SampleInfo


@dataclass(frozen=True)
class ExperienceLayout:
    packed: bool
    token_ids: torch.Tensor  # (B, T) or packed (1, N): the id each loss position scores
    loss_mask: torch.Tensor  # same shape, bool: the action positions the action mask keeps
    cu_seqlens: torch.Tensor | None  # (B + 1,) packed only
    sample_ids: tuple[str, ...] | None
    infos: tuple[SampleInfo, ...]
    action_index: torch.Tensor  # (B, A) long: loss position of action j of row i (−1: not a token)

    def micro_batch_kwargs(self) -> dict[str, Any]:
        """What ``mon.micro_batch(**...)`` takes for this experience."""
        return micro_batch_kwargs(self)

    def to_positions(self, per_action: torch.Tensor, name: str = "field", fill: float = float("nan")) -> torch.Tensor:
        """A (B, A) per-action tensor → the layout's shape, at the positions the action mask keeps."""
        want = tuple(self.action_index.shape)
        if not isinstance(per_action, torch.Tensor) or tuple(per_action.shape) != want:
            raise BatchMetadataError(f"{name}: expected {want} like action_mask, got {describe(per_action)}")
        on = self.loss_mask.reshape(-1)[self.action_index.clamp(min=0)] & (self.action_index >= 0)  # (B, A)
        out = torch.full((self.token_ids.numel(),), fill, dtype=torch.float32, device=per_action.device)
        out[self.action_index[on].to(per_action.device)] = per_action[on.to(per_action.device)].float()
        return out.view(self.token_ids.shape)  # (n,) -> (B, T) or (1, N)

    def to_actions(self, positions: torch.Tensor) -> torch.Tensor:
        """A tensor in the layout's shape (a probe's token mask) → (B, A) per action."""
        flat = positions.reshape(-1)  # (B, T) or (1, N) -> (n,)
        valid = (self.action_index >= 0).to(flat.device)
        picked = flat[self.action_index.clamp(min=0).to(flat.device)]
        return torch.where(valid, picked, torch.zeros((), dtype=flat.dtype, device=flat.device))


def layout(experience: Any, *, packed: bool = False, sample_ids: Sequence[object] | None = None,
           pad_id: int = 0, provenance: Sequence[tuple[str | None, str | None]] | None = None) -> ExperienceLayout:
    """The gradloc layout of one OpenRLHF micro-batch experience; raises :class:`BatchMetadataError`.

    ``packed``: the actor runs with ``packing_samples`` (``args.ds.packing_samples``). ``sample_ids``:
    one per row; by default ``experience.index`` when it holds one rollout index per row. ``provenance``: one
    (source, origin) per row (:class:`PromptProvenance`); packed or not, each row keeps its own.
    """
    seq, att, am = (getattr(experience, k, None) for k in ("sequences", "attention_mask", "action_mask"))
    for name, t in (("sequences", seq), ("attention_mask", att), ("action_mask", am)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise BatchMetadataError(f"the experience's {name} must be a 2-D tensor, got {describe(t)}")
    B, T = seq.shape
    A = am.shape[1]
    if tuple(att.shape) != (B, T) or am.shape[0] != B:
        raise BatchMetadataError(f"sequences {tuple(seq.shape)}, attention_mask {tuple(att.shape)} and action_mask "
                                 f"{tuple(am.shape)} do not describe the same rows")
    if not 1 <= A <= T - 1:
        raise BatchMetadataError(f"action_mask has {A} columns for sequences of {T} tokens (at most T − 1 = {T - 1}: "
                                 "action j is token T − A + j)")
    seq, att, act = seq.detach().cpu().long(), att.detach().cpu().bool(), am.detach().cpu().bool()
    offset = T - 1 - A  # logits position of action 0
    scored = att[:, 1:]  # (B, T − 1): position p scores an attended token p + 1
    hole = act & ~scored[:, offset:]
    if bool(hole.any()):
        i, j = (int(x) for x in hole.nonzero()[0])
        raise BatchMetadataError(f"row {i}: action {j} is token {offset + j + 1}, which the attention_mask leaves out")
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, offset:T - 1] = act
    targets = torch.cat([seq[:, 1:], torch.full((B, 1), pad_id, dtype=torch.long)], 1)  # (B, T): position p → token p+1
    targets[~torch.cat([scored, torch.zeros(B, 1, dtype=torch.bool)], 1)] = pad_id
    pos = torch.arange(offset, T - 1)[None].expand(B, A)  # (B, A): logits position of action j
    ids = _sample_ids(experience, sample_ids, B)
    first = att.float().argmax(1)  # (B,): first attended column (left padding)
    infos = _infos(experience, act, offset, first if packed else torch.zeros(B, dtype=torch.long))
    infos = with_row_provenance(infos, provenance)
    if not packed:
        index = torch.where(scored[:, offset:], torch.arange(B)[:, None] * T + pos, -1)  # (B, A)
        return ExperienceLayout(False, targets, mask, None, ids, infos, index)
    lens = att.sum(1)  # (B,)
    if bool((lens == 0).any()) or not torch.equal(att, (torch.arange(T)[None] >= first[:, None]) &
                                                   (torch.arange(T)[None] < (first + lens)[:, None])):
        raise BatchMetadataError("packing needs each row's attended tokens to be one non-empty run")
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    index = torch.where(scored[:, offset:], cu[:-1, None] + pos - first[:, None], -1)  # (B, A)
    return ExperienceLayout(True, targets[att][None], mask[att][None], cu, ids, infos, index)  # (B, T) -> (1, N)


def rl_fields(lay: ExperienceLayout, experience: Any, log_probs: torch.Tensor | None = None, *,
              clip_eps: tuple[float, float] | None = None, entropy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``mon.rl_fields(**...)``: ``logp`` = the actor's action log-probs the loss used, ``old_logp`` =
    action_log_probs, ``rollout_logp`` = rollout_log_probs (None without IS correction),
    ``advantages``; ``ratio`` = exp(clamp(logp − old, ±20)) as PolicyLoss computes it, and with
    ``clip_eps`` = (low, high) ``clipped`` (surr2 < surr1: PolicyLoss's clip_ratio). ``entropy``: the actor
    output's token entropies (B, T − 1), as ``training_step`` computes them for its entropy loss; its last
    A columns are the actions' (A = action_mask's width, as ``training_step`` slices them)."""
    out: dict[str, torch.Tensor] = {}
    for name, attr in (("old_logp", "action_log_probs"), ("rollout_logp", "rollout_log_probs"),
                       ("advantages", "advantages")):
        value = getattr(experience, attr, None)
        if value is not None:
            out[name] = lay.to_positions(value, attr)
    if log_probs is not None:
        out["logp"] = lay.to_positions(log_probs.detach(), "log_probs")
    if entropy is not None:
        A = experience.action_mask.shape[1]
        if isinstance(entropy, torch.Tensor) and entropy.dim() == 2:
            entropy = entropy.detach()[:, -A:]  # (B, T − 1) -> (B, A); another shape: to_positions says which
        out["entropy"] = lay.to_positions(entropy, "entropy")  # (B, A) -> the layout's positions
    if "logp" in out and "old_logp" in out:
        ratio = torch.exp(torch.clamp(out["logp"] - out["old_logp"], -20.0, 20.0))
        out["ratio"] = ratio
        adv = out.get("advantages")
        if clip_eps is not None and adv is not None:
            lo, hi = clip_eps
            out["clipped"] = torch.clamp(ratio, 1 - lo, 1 + hi) * adv < ratio * adv  # NaN outside: False
    return out


class PromptProvenance:
    """``experience`` → one (source, origin) per row, from OpenRLHF's ``PromptDataset`` (or anything with its
    ``prompts`` and ``datasources`` lists). OpenRLHF reads each prompt row's ``datasource`` (default
    ``"default"``: none given) but drops it before the rollout (``_collect_prompt_batch``); the experience keeps
    the prompt text (``experience.prompts``), so rows are matched by it, as OpenRLHF's own evaluation maps
    prompts to datasources. Source: the datasource (none for ``"default"``); origin ``"<where>:<i>"``, i the
    prompt's index in the dataset. A prompt text found at several indices gets no origin (and no source unless
    they agree). Build it where the hooks run (the actor's process) from the same prompt data; it holds one
    dict entry per distinct prompt."""

    def __init__(self, prompt_dataset: Any, where: str = "prompts") -> None:
        prompts = list(prompt_dataset.prompts)
        sources = list(getattr(prompt_dataset, "datasources", None) or [None] * len(prompts))
        self.where, self.sources = where, [None if s in (None, "", "default") else str(s) for s in sources]
        self.rows: dict[str, int] = {}  # prompt text → its index; −1 when it is at several
        self.shared: dict[str, str | None] = {}  # the source of a prompt at several indices, when they agree
        for i, p in enumerate(prompts):
            j = self.rows.get(p)
            if j is None:
                self.rows[p] = i
                continue
            source = self.sources[j] if j >= 0 else self.shared[p]  # what the earlier occurrences agree on
            self.rows[p], self.shared[p] = -1, source if source == self.sources[i] else None
        SampleInfo(origin=f"{where}:{len(prompts)}")  # the checks, here, before training: the longest origin
        for s in {s for s in self.sources if s is not None}:
            SampleInfo(source=s)  # and every datasource

    def __call__(self, experience: Any) -> list[tuple[str | None, str | None]] | None:
        prompts = getattr(experience, "prompts", None)
        if not isinstance(prompts, (list, tuple)):
            return None
        out: list[tuple[str | None, str | None]] = []
        for p in prompts:
            i = self.rows.get(p) if isinstance(p, str) else None
            if i is None:
                out.append((None, None))
            elif i < 0:
                out.append((self.shared.get(p), None))
            else:
                out.append((self.sources[i], f"{self.where}:{i}"))
        return out


def _sample_ids(experience: Any, given: Sequence[object] | None, B: int) -> tuple[str, ...] | None:
    ids = given if given is not None else getattr(experience, "index", None)
    if ids is None:
        return None
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    if len(ids) != B:
        if given is None:
            return None  # OpenRLHF clears index when it splits a batch: no ids rather than wrong ones
        raise BatchMetadataError(f"sample_ids has {len(ids)} entries for {B} rows")
    return tuple(str(x) for x in ids)


def _infos(experience: Any, act: torch.Tensor, offset: int, first: torch.Tensor) -> tuple[SampleInfo, ...]:
    """Spans in the layout's per-sample positions: the response from the first to the last action."""
    truncated = getattr(experience, "truncated", None)
    out = []
    for i in range(act.shape[0]):
        on = act[i].nonzero().reshape(-1)
        start = offset + int(on[0]) - int(first[i]) if on.numel() else 0
        length = int(on[-1] - on[0]) + 1 if on.numel() else 0
        finish = None
        if isinstance(truncated, torch.Tensor) and truncated.numel() == act.shape[0]:
            finish = "length" if bool(truncated.reshape(-1)[i]) else "stop"
        out.append(SampleInfo(None, None, start + 1, start, length, finish))
    return tuple(out)
