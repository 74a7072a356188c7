"""verl micro-batches → gradloc's layout, duck-typed (no verl, tensordict or ray import).

What a verl 0.9 actor micro-batch holds (a ``TensorDict``; a ``dict`` works the same): ``input_ids`` and
``position_ids`` as jagged nested tensors (B, j) — prompt + response, no padding; response-level
fields ``response_mask``, ``old_log_probs``, ``advantages``, ``rollout_log_probs``,
``rollout_is_weights``, ``ref_log_prob`` either padded (B, R) (the legacy trainer's
``left_right_2_no_padding``) or nested (B, j_resp); ``prompts``/``responses``/``attention_mask`` that
give each sequence's response length; ``uid`` (one per prompt, repeated over its n samples).

With ``use_remove_padding`` (the default) the model sees one packed row (1, N): the sequences back to
back, ``cu_seqlens = input_ids.offsets()``, and ``log_probs`` value q is log π(token q + 1). That is
gradloc's *loss position* q. Response token k of sample i is token ``off[i+1] − r_i + k`` and is scored
at loss position ``off[i+1] − r_i + k − 1`` (r_i: its response length). The last position of each
sequence scores nothing (verl's roll wraps it into the next sequence; no mask selects it). Without
remove-padding the model sees (B, L) right-padded rows and position p of row i is loss position i·L + p.

:class:`VerlLayout` holds that mapping; :func:`rl_fields` and :func:`masked_loss_function` use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from gradloc.errors import BatchMetadataError
from gradloc.integrations.jagged import describe, micro_batch_kwargs, nest, non_tensor, to_rows, values_of, where_values
from gradloc.integrations.provenance import verl_provenance
from gradloc.records import SampleInfo

PAD_SAMPLE = "<pad>"  # the sample id of a static pad appended to a packed row (engine pad_to_length)


@dataclass(frozen=True)
class VerlLayout:
    packed: bool
    token_ids: torch.Tensor  # (1, N + pad) packed or (B, L) padded: the id each loss position scores
    loss_mask: torch.Tensor  # same shape, bool: response positions the response_mask keeps
    cu_seqlens: torch.Tensor | None  # (S + 1,) packed only (with the pad as one more sequence)
    sample_ids: tuple[str, ...] | None
    infos: tuple[SampleInfo, ...]
    seq_lens: torch.Tensor  # (B,) long
    resp_lens: torch.Tensor  # (B,) long
    flat_index: torch.Tensor  # (B, R) long: loss position of response token k of sample i (−1 past r_i)

    @property
    def batch(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def width(self) -> int:
        return int(self.flat_index.shape[1])

    @property
    def n_values(self) -> int:
        return int(self.seq_lens.sum())

    def micro_batch_kwargs(self) -> dict[str, Any]:
        """What ``mon.micro_batch(**...)`` takes for this micro-batch."""
        return micro_batch_kwargs(self)

    def response_token(self, sample: int, position: int) -> int | None:
        """A culprit's (sample, position within the sample) → its response token index k (None in the prompt)."""
        k = position - self.infos[sample].response_start
        return k if 0 <= k < int(self.resp_lens[sample]) else None

    def to_positions(self, resp: torch.Tensor, fill: float = float("nan"), name: str = "field") -> torch.Tensor:
        """A response-level field, (B, R) padded or nested (B, j), → the layout's shape (``fill`` elsewhere)."""
        dense = self.dense_response(resp, name)
        valid = self.flat_index >= 0  # (B, R)
        out = torch.full((self.token_ids.numel(),), fill, dtype=torch.float32, device=dense.device)
        out[self.flat_index[valid].to(dense.device)] = dense[valid.to(dense.device)].float()
        return out.view(self.token_ids.shape)  # (n,) -> (1, N) or (B, L)

    def values_to_positions(self, values: torch.Tensor, fill: float = float("nan")) -> torch.Tensor:
        """The model's N per-position outputs (nested over the sequences, or (N,)) → the layout's shape."""
        v = values_of(values).reshape(-1)
        if v.numel() != self.n_values:
            raise BatchMetadataError(f"the model output has {v.numel()} positions, the micro-batch {self.n_values}")
        if not self.packed:
            return to_rows(v.float(), self.seq_lens, fill)  # (N,) -> (B, L)
        out = torch.full((self.token_ids.numel(),), fill, dtype=torch.float32, device=v.device)
        out[: v.numel()] = v.float()
        return out[None]  # (N + pad,) -> (1, N + pad)

    def to_response(self, positions: torch.Tensor) -> torch.Tensor:
        """A tensor in the layout's shape (e.g. a probe's token mask) → (B, R) at the response tokens."""
        flat = positions.reshape(-1)  # (1, N) or (B, L) -> (n,)
        valid = self.flat_index >= 0
        idx = self.flat_index.clamp(min=0).to(flat.device)
        return torch.where(valid.to(flat.device), flat[idx], torch.zeros((), dtype=flat.dtype, device=flat.device))

    def values_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """A bool tensor in the layout's shape → (N,) over the model's output values."""
        if self.packed:
            return positions.reshape(-1)[: self.n_values]  # (1, N + pad) -> (N,)
        B, L = self.token_ids.shape
        valid = torch.arange(L)[None] < self.seq_lens[:, None]  # (B, L)
        return positions[valid.to(positions.device)]  # (B, L) -> (N,) row by row

    def dense_response(self, resp: torch.Tensor, name: str) -> torch.Tensor:
        """(B, R) from a padded or nested response-level field, checked against the response lengths."""
        if getattr(resp, "is_nested", False):
            lens = resp.offsets().diff().cpu()
            if lens.numel() != self.batch or not torch.equal(lens, self.resp_lens):
                raise BatchMetadataError(f"{name}: nested response lengths {lens.tolist()[:8]} differ from the "
                                         f"micro-batch's {self.resp_lens.tolist()[:8]}")
            return resp.to_padded_tensor(0, output_size=(self.batch, self.width))
        if not isinstance(resp, torch.Tensor) or resp.dim() != 2 or tuple(resp.shape) != (self.batch, self.width):
            raise BatchMetadataError(f"{name}: expected ({self.batch}, {self.width}) like response_mask, got {describe(resp)}")
        return resp

    def response_like(self, template: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """(B, R) values in the format of ``template``: padded as it is, or nested like it."""
        if getattr(template, "is_nested", False):
            valid = (self.flat_index >= 0).to(dense.device)
            return nest(dense[valid], template.offsets())
        return dense


def layout(micro_batch: Mapping[str, Any], *, cu_seqlens: Any = None, packed: bool | None = None,
           pad_size: int = 0, pad_id: int = 0, uid_key: str = "uid") -> VerlLayout:
    """The gradloc layout of one verl micro-batch; raises :class:`BatchMetadataError` on bad input.

    ``packed``: the model's view (default: the micro-batch's ``use_remove_padding``, True if absent).
    ``cu_seqlens``: for an already-packed (1, N) ``input_ids``. ``pad_size``: tokens the engine appends
    to the packed row (``pad_to_length``), scored nowhere.
    """
    values, off = _sequences(micro_batch, cu_seqlens)
    seq_lens = off.diff()
    B = seq_lens.numel()
    _check_positions(micro_batch.get("position_ids"), off)
    resp_lens = _response_lengths(micro_batch, B)
    bad = (resp_lens < 0) | (resp_lens > seq_lens - 1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise BatchMetadataError(f"sample {i}: response of {int(resp_lens[i])} tokens in a sequence of "
                                 f"{int(seq_lens[i])} (verl needs a prompt of at least one token)")
    rmask = micro_batch.get("response_mask")
    if rmask is None:
        raise BatchMetadataError("the micro-batch has no response_mask (the policy loss's token mask)")
    width = int(rmask.offsets().diff().max()) if getattr(rmask, "is_nested", False) else _width(rmask, B)
    if B and int(resp_lens.max()) > width:
        raise BatchMetadataError(f"a response of {int(resp_lens.max())} tokens does not fit response_mask's width {width}")
    packed = bool(non_tensor(micro_batch.get("use_remove_padding", True))) if packed is None else packed
    if pad_size and not packed:
        raise BatchMetadataError("pad_size applies to a packed row only")
    k = torch.arange(width)[None]  # (1, R)
    valid = k < resp_lens[:, None]  # (B, R)
    within = (seq_lens - resp_lens - 1)[:, None] + k  # (B, R): loss position inside the sequence
    L = int(seq_lens.max()) if B else 0
    start = off[:-1, None] if packed else torch.arange(B)[:, None] * L  # (B, 1): where each sequence starts
    flat = torch.where(valid, start + within, -1)  # (B, R)
    targets = _targets(values, off, pad_id)  # (N,)
    if packed:
        n = int(off[-1])
        token_ids = torch.cat([targets, torch.full((pad_size,), pad_id, dtype=targets.dtype)])[None]  # (1, N + pad)
        cu = torch.cat([off, torch.tensor([n + pad_size])]) if pad_size else off.clone()
    else:
        token_ids = to_rows(targets, seq_lens, pad_id)  # (N,) -> (B, L)
        cu = None
    base = VerlLayout(packed, token_ids, token_ids, cu, None, (), seq_lens, resp_lens, flat)
    keep = base.dense_response(rmask, "response_mask").to(torch.bool).cpu() & valid
    mask = torch.zeros(token_ids.numel(), dtype=torch.bool)
    mask[flat[keep]] = True
    ids, infos = _samples(micro_batch.get(uid_key), B, seq_lens, resp_lens)
    infos = verl_provenance(infos, micro_batch.get("data_source"), micro_batch.get("extra_info"))
    if pad_size:
        ids = None if ids is None else (*ids, PAD_SAMPLE)
        infos = (*infos, SampleInfo())
    return VerlLayout(packed, token_ids, mask.view(token_ids.shape), cu, ids, infos, seq_lens, resp_lens, flat)


def rl_fields(lay: VerlLayout, micro_batch: Mapping[str, Any], log_probs: Any = None, *,
              clip_ratio: tuple[float, float] | None = None, entropy: Any = None) -> dict[str, torch.Tensor]:
    """``mon.rl_fields(**...)`` for one micro-batch: ``logp`` from the model output the loss used
    (``model_output["log_probs"]``), ``old_logp`` = old_log_probs, ``rollout_logp`` =
    rollout_log_probs, ``advantages``; ``ratio`` = exp(clamp(logp − old, ±20)) as verl computes it, and
    with ``clip_ratio`` = (low, high) ``clipped`` (the PPO min took the clipped term: verl's pg_clipfrac);
    ``entropy`` from the model output when the engine computed it (``calculate_entropy``: the policy's token
    entropies, laid out as the log-probs)."""
    out: dict[str, torch.Tensor] = {}
    for name, key in (("old_logp", "old_log_probs"), ("rollout_logp", "rollout_log_probs"),
                      ("advantages", "advantages")):
        value = micro_batch.get(key)
        if value is not None:
            out[name] = lay.to_positions(value, name=key)
    if log_probs is not None:
        out["logp"] = lay.values_to_positions(log_probs)
    if entropy is not None:
        out["entropy"] = lay.values_to_positions(entropy).detach()
    if "logp" in out and "old_logp" in out:
        ratio = torch.exp(torch.clamp(out["logp"] - out["old_logp"].to(out["logp"].device), -20.0, 20.0))
        out["ratio"] = ratio
        adv = out.get("advantages")
        if clip_ratio is not None and adv is not None:
            lo, hi = clip_ratio
            adv = adv.to(ratio.device)
            out["clipped"] = torch.clamp(ratio, 1 - lo, 1 + hi) * adv < ratio * adv  # NaN outside: False
    return out


def masked_loss_function(loss_function: Callable[..., Any], lay: VerlLayout, token_mask: torch.Tensor) -> Callable[..., Any]:
    """verl's loss restricted to the tokens in ``token_mask`` (the layout's shape), same normalization.

    The loss sees ``rollout_is_weights`` × mask (ones × mask when the batch has none): every policy
    loss in verl's core_algos multiplies its per-token terms by these weights before ``agg_loss``,
    whose normalizers (``batch_num_tokens``, ``dp_size``, the response_mask counts) are untouched. The
    KL term gets ``ref_log_prob`` = the current log-prob outside the mask (every kl_penalty is 0 there),
    the entropy is 0 outside it, and ``log_probs`` carries no gradient outside it — so each term of
    ppo_loss (policy, entropy, KL) keeps exactly the masked tokens' share, in value and gradient.
    """
    keep_values = lay.values_mask(token_mask.to(torch.bool))  # (N,)
    keep_resp = lay.to_response(token_mask.to(torch.bool))  # (B, R)

    def probe_loss(*args: Any, **kw: Any) -> Any:
        if "model_output" not in kw:  # verl's logits-processor call (top-k distillation): unchanged
            return loss_function(*args, **kw)
        model_output, data = kw.pop("model_output"), kw.pop("data")
        out = dict(model_output)
        lp = out.get("log_probs")
        if lp is not None:
            out["log_probs"] = where_values(lp, keep_values, detach_outside=True)
        if out.get("entropy") is not None:
            out["entropy"] = where_values(out["entropy"], keep_values, detach_outside=False)
        d = data.copy() if hasattr(data, "copy") else dict(data)
        template = data.get("response_mask")
        dev = values_of(template).device
        keep = keep_resp.to(dev)
        w = data.get("rollout_is_weights")
        base = lay.dense_response(w, "rollout_is_weights") if w is not None else torch.ones(keep.shape, device=dev)
        d["rollout_is_weights"] = lay.response_like(template, base * keep.to(base.dtype))
        ref = data.get("ref_log_prob")
        if ref is not None and lp is not None:
            current = lay.to_response(lay.values_to_positions(values_of(lp).detach())).to(dev)  # (B, R)
            dense = lay.dense_response(ref, "ref_log_prob")
            d["ref_log_prob"] = lay.response_like(ref, torch.where(keep, dense, current.to(dense.dtype)))
        return loss_function(*args, model_output=out, data=d, **kw)

    return probe_loss


# -- helpers ----------------------------------------------------------------------------------------
def _sequences(mb: Mapping[str, Any], cu_seqlens: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ids = mb.get("input_ids")
    if ids is None:
        raise BatchMetadataError("the micro-batch has no input_ids")
    if getattr(ids, "is_nested", False):
        if cu_seqlens is not None:
            raise BatchMetadataError("cu_seqlens is for packed (1, N) input_ids; nested input_ids carry their own offsets")
        return ids.values().detach().cpu().long(), ids.offsets().cpu().long()
    cu = cu_seqlens if cu_seqlens is not None else non_tensor(mb.get("cu_seqlens"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or cu is None:
        raise BatchMetadataError(f"input_ids must be nested (B, j) or packed (1, N) with cu_seqlens, got {describe(ids)}"
                                 + ("" if cu is not None or not isinstance(ids, torch.Tensor) else " without cu_seqlens"))
    off = torch.as_tensor(cu).detach().cpu().long().reshape(-1)
    n = ids.shape[1]
    if off.numel() < 2 or int(off[0]) != 0 or int(off[-1]) != n or bool((off.diff() <= 0).any()):
        raise BatchMetadataError(f"cu_seqlens {off.tolist()[:8]} must rise strictly from 0 to the row's N = {n}")
    return ids[0].detach().cpu().long(), off


def _check_positions(pos: Any, off: torch.Tensor) -> None:
    """Position ids must restart at 0 exactly at each sequence start (3-D M-RoPE ids are not checked)."""
    if pos is None:
        return
    v = pos.values() if getattr(pos, "is_nested", False) else pos
    if not isinstance(v, torch.Tensor) or v.dim() > 2 or (v.dim() == 2 and v.shape[0] != 1):
        return  # (4, N) / (B, 4, j) M-RoPE ids: no per-token restart to check
    v = v.reshape(-1).detach().cpu()
    if v.numel() != int(off[-1]):
        raise BatchMetadataError(f"position_ids has {v.numel()} entries for {int(off[-1])} tokens")
    starts = (v == 0).nonzero().reshape(-1)
    if not torch.equal(starts, off[:-1]):
        raise BatchMetadataError(f"position_ids restart at {starts.tolist()[:8]}, but the sequences start at "
                                 f"{off[:-1].tolist()[:8]}: the boundaries do not add up")


def _response_lengths(mb: Mapping[str, Any], B: int) -> torch.Tensor:
    """Each sequence's response length, the way verl's no_padding_2_padding finds it."""
    for key in ("responses", "response_mask"):
        t = mb.get(key)
        if getattr(t, "is_nested", False):
            lens = t.offsets().diff().cpu().long()
            if lens.numel() != B:
                raise BatchMetadataError(f"{key} has {lens.numel()} sequences, input_ids {B}")
            return lens
    prompts, am = mb.get("prompts"), mb.get("attention_mask")
    if isinstance(prompts, torch.Tensor) and isinstance(am, torch.Tensor) and prompts.dim() == 2 and am.dim() == 2:
        if am.shape[0] != B or prompts.shape[0] != B or am.shape[1] <= prompts.shape[1]:
            raise BatchMetadataError(f"prompts {tuple(prompts.shape)} and attention_mask {tuple(am.shape)} do not "
                                     f"describe {B} prompt + response rows")
        return am[:, prompts.shape[1]:].sum(1).cpu().long()  # (B, P + R) -> (B,)
    raise BatchMetadataError("cannot tell the response lengths: the micro-batch needs nested responses (or "
                             "response_mask), or padded prompts with the attention_mask")


def _samples(uid: Any, B: int, seq_lens: torch.Tensor, resp_lens: torch.Tensor
             ) -> tuple[tuple[str, ...] | None, tuple[SampleInfo, ...]]:
    """Sample ids from uid (+ '#k', the k-th occurrence in this micro-batch, when a uid repeats) and a
    SampleInfo per sequence (spans in per-sequence loss positions)."""
    uids = non_tensor(uid)
    if uids is not None:
        uids = [str(u) for u in (uids.tolist() if hasattr(uids, "tolist") else list(uids))]
        if len(uids) != B:
            raise BatchMetadataError(f"uid has {len(uids)} entries for {B} sequences")
    infos, ids, seen = [], [], {}
    for i in range(B):
        p, r = int(seq_lens[i] - resp_lens[i]), int(resp_lens[i])
        infos.append(SampleInfo(uids[i] if uids else None, None, p, p - 1, r, None))
        if uids:
            ids.append(uids[i])
            seen[uids[i]] = seen.get(uids[i], 0) + 1
    if not uids:
        return None, tuple(infos)
    if len(seen) < B:
        k: dict[str, int] = {}
        for i, u in enumerate(uids):
            ids[i], k[u] = f"{u}#{k.get(u, 0)}", k.get(u, 0) + 1
    return tuple(ids), tuple(infos)


def _targets(values: torch.Tensor, off: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(N,) token q + 1 of the same sequence at each q; pad_id at each sequence's last position."""
    t = torch.roll(values, -1)
    t[off[1:] - 1] = pad_id
    return t


def _width(t: Any, B: int) -> int:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != B:
        raise BatchMetadataError(f"response_mask must be (B={B}, R) or nested, got {describe(t)}")
    return int(t.shape[1])
