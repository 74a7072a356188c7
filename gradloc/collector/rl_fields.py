"""Per-token RL fields of a micro-batch, and their per-step distributions.

The trainer hands over tensors its loss already has (``Monitor.rl_fields`` inside the micro-batch
block): log π_train of the sampled tokens, log π_rollout (the inference engine's), log π_old,
advantages, the importance ratio, the clipped flags, the entropy. They stay on the device. At
``end_step`` they are reduced there to a fixed-size pack (histogram counts, maxima, fractions) that
travels in the step's one host transfer; only a spike step copies the full per-token values to the
host, to attach each culprit's own values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np
import torch

from gradloc.collector.batch import MicroBatchMeta
from gradloc.collector.packs import Pack
from gradloc.errors import BatchMetadataError
from gradloc.records import RL_ADVANTAGE_BUCKETS, RL_LOG_RATIO_BUCKETS, RLStats

if TYPE_CHECKING:
    from gradloc.collector.token_summary import StepScores

MISMATCH_LOG_RATIO = math.log(2.0)  # |log π_old − log π_rollout| above this counts as a mismatched token


@dataclass(frozen=True)
class RLTensors:
    """One micro-batch's fields in its (B, T) layout (packed: (1, N)), detached copies on the device."""

    logp: torch.Tensor | None = None
    rollout_logp: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    ratio: torch.Tensor | None = None
    clipped: torch.Tensor | None = None  # bool
    entropy: torch.Tensor | None = None


FIELDS = tuple(f.name for f in fields(RLTensors))


def make_rl(meta: MicroBatchMeta, given: Mapping[str, torch.Tensor | None]) -> RLTensors:
    """Validate and copy one micro-batch's fields; raises :class:`BatchMetadataError`.

    Every field is (B, T) like the micro-batch; ``advantages`` may also be one per sample: (B,) for
    a padded micro-batch, (S,) per sequence of a packed one.
    """
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise BatchMetadataError(f"unknown RL field(s) {unknown}; known: {list(FIELDS)}")
    shape = (meta.batch, meta.seq)
    out: dict[str, torch.Tensor] = {}
    for name, t in given.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise BatchMetadataError(f"RL field {name} must be a tensor, got {type(t).__name__}")
        t = t.detach()
        if name == "advantages" and t.dim() == 1 and t.shape[0] == meta.n_samples:
            t = _per_sample(meta, t)
        if tuple(t.shape) != shape:
            want = f"{shape}" + (f" or ({meta.n_samples},) per sample" if name == "advantages" else "")
            raise BatchMetadataError(f"RL field {name} has shape {tuple(t.shape)}, the micro-batch needs {want}")
        out[name] = t.to(torch.bool).clone() if name == "clipped" else t.to(torch.float32).clone()
    return RLTensors(**out)


def _per_sample(meta: MicroBatchMeta, adv: torch.Tensor) -> torch.Tensor:
    """(samples,) -> (B, T): each sample's advantage on all of its positions."""
    if not meta.packed:
        return adv[:, None].expand(meta.batch, meta.seq)  # (B,) -> (B, T)
    lengths = torch.tensor([b - a for a, b in (meta.bounds(s) for s in range(meta.n_samples))], device=adv.device)
    return torch.repeat_interleave(adv, lengths)[None]  # (S,) -> (N,) -> (1, N)


# -- the per-step pack ------------------------------------------------------------------------------
_K1, _K2 = len(RL_LOG_RATIO_BUCKETS) + 1, len(RL_ADVANTAGE_BUCKETS) + 1
_PRESENT = ("rollout_logp", "old_logp", "clipped", "advantages", "entropy")
# the step's RL distributions, one float64 vector (collector/packs.py): tokens with fields, which fields were
# given, the mismatch log ratio's histogram + Σ + max|·| + count over the line, max |log π_train − log π_old|, clipped
# tokens, the advantage's histogram + Σ + max|·| + Σ², Σ entropy, Σ (exp(r) − 1 − r) of the mismatch log ratio r (k3 KL)
RL_PACK = Pack.of(tokens=1, present=len(_PRESENT), lr_counts=_K1, lr_sum=1, lr_max=1, mismatch=1, old_max=1,
                  clipped=1, adv_counts=_K2, adv_sum=1, adv_max=1, adv_sq=1, entropy=1, kl=1)


def stack(metas: Sequence[MicroBatchMeta], rl: Mapping[int, RLTensors], device: torch.device) -> dict[str, torch.Tensor]:
    """Each field over the step's positions, (N,) in micro-batch order, NaN (clipped: False) where a
    micro-batch did not give it; plus ``has`` (N,): positions of micro-batches with RL fields."""
    out: dict[str, list[torch.Tensor]] = {name: [] for name in (*FIELDS, "has")}
    for meta in metas:
        r = rl.get(meta.index)
        n = meta.n_tokens
        for name in FIELDS:
            t = getattr(r, name) if r is not None else None
            if t is None:
                t = torch.zeros(n, dtype=torch.bool, device=device) if name == "clipped" else \
                    torch.full((n,), math.nan, device=device)
            out[name].append(t.reshape(n).to(device))  # (B, T) -> (B·T,)
        out["has"].append(torch.full((n,), r is not None, dtype=torch.bool, device=device))
    return {name: torch.cat(ts) for name, ts in out.items()}


def rl_pack(fields_: Mapping[str, torch.Tensor], eligible: torch.Tensor, given: set[str]) -> torch.Tensor:
    """The step's distributions as one float64 vector laid out as RL_PACK (see :func:`unpack_rl`), over
    the loss positions of the micro-batches that gave RL fields. ``given``: the field names given."""
    dev = eligible.device
    on = eligible & fields_["has"]  # (N,)
    n = on.sum()
    needs = {"rollout_logp": {"logp", "old_logp"}, "old_logp": {"logp"}}  # each ratio needs one of these too
    present = [float(f in given and (f not in needs or bool(needs[f] & given))) for f in _PRESENT]
    trainer = torch.where(torch.isfinite(fields_["old_logp"]), fields_["old_logp"], fields_["logp"])
    lr = trainer - fields_["rollout_logp"]  # mismatch: the same policy scored by trainer and engine
    lr_counts, lr_sum, lr_max = _hist(lr, on & torch.isfinite(lr), RL_LOG_RATIO_BUCKETS, with_sum=True)
    old = fields_["logp"] - fields_["old_logp"]
    adv = fields_["advantages"]
    ok = on & torch.isfinite(adv)
    adv_counts, adv_sum, adv_max = _hist(adv, ok, RL_ADVANTAGE_BUCKETS, with_sum=True)
    ent = fields_["entropy"]
    r = torch.where(on & torch.isfinite(lr), lr, 0.0).double()  # (N,) 0 where not counted: exp(0) − 1 − 0 = 0
    return RL_PACK.build(
        tokens=n.double(), present=torch.tensor(present, dtype=torch.float64, device=dev),
        lr_counts=lr_counts, lr_sum=lr_sum, lr_max=lr_max,
        mismatch=((lr.abs() > MISMATCH_LOG_RATIO) & on & torch.isfinite(lr)).sum().double(),
        old_max=_max_abs(old, on & torch.isfinite(old)), clipped=(fields_["clipped"] & on).sum().double(),
        adv_counts=adv_counts, adv_sum=adv_sum, adv_max=adv_max,
        adv_sq=torch.where(ok, adv, 0.0).double().pow(2).sum(),
        entropy=torch.where(on & torch.isfinite(ent), ent, 0.0).double().sum(),
        kl=(torch.expm1(r) - r).sum())  # (len(RL_PACK),)


def _max_abs(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    return torch.where(ok, x.abs(), 0.0).double().amax()[None] if x.numel() else torch.zeros(1, dtype=torch.float64, device=x.device)


def _hist(x: torch.Tensor, ok: torch.Tensor, bounds: tuple[float, ...], with_sum: bool) -> list[torch.Tensor]:
    """[counts (K + 1)] + [Σx, max|x|] for the positions in ``ok``."""
    b = torch.tensor(bounds, dtype=torch.float32, device=x.device)
    idx = torch.bucketize(torch.where(ok, x, 0.0), b)  # (N,) bucket i: bounds[i-1] < x <= bounds[i]
    counts = torch.zeros(len(bounds) + 1, dtype=torch.float64, device=x.device).index_add_(0, idx, ok.double())
    if not with_sum:
        return [counts]
    return [counts, torch.where(ok, x, 0.0).double().sum()[None], _max_abs(x, ok)]


def unpack_rl(host: np.ndarray) -> RLStats:
    get = lambda name: RL_PACK.get(host, name)  # noqa: E731
    n = int(get("tokens")[0])
    present = dict(zip(_PRESENT, (bool(x) for x in get("present"))))
    lr_counts, lr_sum, lr_max, mismatch = get("lr_counts"), get("lr_sum")[0], get("lr_max")[0], get("mismatch")[0]
    old_max, clipped = get("old_max")[0], get("clipped")[0]
    adv_counts, adv_sum, adv_max, adv_sq = get("adv_counts"), get("adv_sum")[0], get("adv_max")[0], get("adv_sq")[0]
    ent, kl = get("entropy")[0], get("kl")[0]
    has_lr, has_adv = present["rollout_logp"] and n > 0, present["advantages"] and n > 0

    def frac(x: float, ok: bool) -> float | None:
        return float(x) / n if ok and n > 0 else None

    return RLStats(
        tokens=n,
        log_ratio_counts=tuple(int(c) for c in lr_counts) if has_lr else (),
        log_ratio_sum=float(lr_sum) if has_lr else None, max_abs_log_ratio=float(lr_max) if has_lr else None,
        mismatch_fraction=frac(mismatch, has_lr),
        max_abs_log_ratio_old=float(old_max) if present["old_logp"] and n > 0 else None,
        clip_fraction=frac(clipped, present["clipped"]),
        advantage_counts=tuple(int(c) for c in adv_counts) if has_adv else (),
        advantage_sum=float(adv_sum) if has_adv else None,
        advantage_rms=math.sqrt(adv_sq / n) if has_adv else None,
        max_abs_advantage=float(adv_max) if has_adv else None,
        entropy_mean=frac(ent, present["entropy"]),
        kl_rollout=frac(kl, has_lr) if math.isfinite(kl) else None,
    )


# a rank's share of the job's policy entropy and KL to the rollout policy (collector/job.py's step gather): the sums
# and the tokens they are over (0 where the rank handed none); the drift detector judges the job's (engine/drift.py)
JOB_RL = Pack.of(entropy=1, entropy_tokens=1, kl=1, kl_tokens=1)


def job_rl_row(pack: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(4,) :data:`JOB_RL` of this rank's :data:`RL_PACK` (zeros without one)."""
    if pack is None:
        return torch.zeros(len(JOB_RL), dtype=torch.float64, device=device)
    present = RL_PACK.get(pack, "present")
    n = RL_PACK.get(pack, "tokens")
    ent_on, kl_on = present[_PRESENT.index("entropy")] > 0, present[_PRESENT.index("rollout_logp")] > 0
    zero = torch.zeros_like(n)
    return JOB_RL.build(entropy=torch.where(ent_on, RL_PACK.get(pack, "entropy"), zero),
                        entropy_tokens=torch.where(ent_on, n, zero),
                        kl=torch.where(kl_on, RL_PACK.get(pack, "kl"), zero), kl_tokens=torch.where(kl_on, n, zero))


def job_rl(rows: np.ndarray) -> tuple[float | None, float | None]:
    """The job's mean token entropy and KL to the rollout policy from every rank's (W, 4) :data:`JOB_RL` rows
    (None where no rank had them): each rank's ``entropy_mean`` / ``kl_rollout`` over the job's tokens."""
    total = rows.sum(0)  # (W, 4) -> (4,)
    ent, n_ent, kl, n_kl = (float(JOB_RL.get(total, f)[0]) for f in ("entropy", "entropy_tokens", "kl", "kl_tokens"))
    return (ent / n_ent if n_ent > 0 else None), (kl / n_kl if n_kl > 0 and math.isfinite(kl) else None)


def step_fields(metas: Sequence[MicroBatchMeta], given_rl: Mapping[int, RLTensors], scores: "StepScores | None",
                device: torch.device) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """The step's RL fields over its positions (device) and their distributions pack (None, None
    when no micro-batch handed any)."""
    if not given_rl or not metas:
        return None, None
    out = stack(metas, given_rl, device)
    if scores is not None:
        eligible = scores.eligible
    else:
        eligible = torch.cat([torch.ones(m.n_tokens, dtype=torch.bool, device=device) if m.loss_mask is None
                              else m.loss_mask.reshape(-1).to(device) for m in metas])  # (B, T) -> (B·T,)
    given = {f for r in given_rl.values() for f in FIELDS if getattr(r, f) is not None}
    out["eligible"] = eligible
    return out, rl_pack(out, eligible, given)
