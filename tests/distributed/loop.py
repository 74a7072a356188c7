"""The training loop every distributed test job shares (DDP, FSDP2, TP, torchtitan, Megatron): per step, M
micro-batches of per-token losses, one ``end_step`` with the probe closure, the optimizer step; and the
picklable essentials of a report that the tests compare across ranks."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch


def run_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, mon: Any,
              batches: tuple[torch.Tensor, torch.Tensor, torch.Tensor], steps: int, *,
              token_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dp: int = 1,
              end_step: Callable[..., Any] | None = None, no_sync: Callable[[int], Any] | None = None,
              after_first_backward: Callable[[], None] | None = None,
              clip: float | Callable[[], Any] | None = None,
              finalize: Callable[[], None] | None = None) -> tuple[list[Any], list[int]]:
    """``batches``: inputs, targets (steps, M, B, T) and loss weights; the loss of micro-batch i is
    Σ w·ce / (B·T·M·dp) (``dp`` = 1 where the data-parallel wrapper averages). ``end_step`` replaces
    ``mon.end_step`` (e.g. the invariants tracer), ``no_sync(i)`` is a context for micro-batch i (DDP's
    accumulation), ``after_first_backward`` runs once after step 0's backward (reference norms), ``finalize``
    after every step's backward, before them (Megatron's reduction of its sequence-parallel gradients); ``clip``:
    a max norm for torch's ``clip_grad_norm_``, or a callable that clips (a framework's own), after ``end_step``.
    Returns the step reports and the gradloc collectives of each step."""
    x, y, w = batches
    M = x.shape[1]
    reports: list[Any] = []
    collectives: list[int] = []
    for s in range(steps):
        def loss_for(i: int, mask: torch.Tensor | None = None, s: int = s) -> torch.Tensor:
            terms = token_losses(model(x[s, i]), y[s, i]) * w[s, i]  # (B, T)
            if mask is not None:
                terms = terms * mask
            return terms.sum() / (terms.numel() * M * dp)

        total = torch.zeros(())
        for i in range(M):
            block = mon.micro_batch(y[s, i]) if mon is not None else contextlib.nullcontext()
            with no_sync(i) if no_sync is not None else contextlib.nullcontext(), block:
                loss = loss_for(i)
                loss.backward()
            total += loss.detach()
        if finalize is not None:
            finalize()
        if s == 0 and after_first_backward is not None:
            after_first_backward()
        if mon is not None:
            before = mon.comm.collectives if mon.comm is not None else 0
            reports.append((end_step or mon.end_step)(total, probe=loss_for))
            collectives.append((mon.comm.collectives if mon.comm is not None else 0) - before)
        if callable(clip):
            clip()
        elif clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return reports, collectives


def essentials(rep: Any) -> dict[str, Any]:
    """A StepReport's figures the tests compare, as plain values."""
    rec = rep.record
    tok = rec.tokens
    top = tok.top if tok else ()
    loc = rep.incident.localization if rep.incident is not None else None
    return {
        "step": rec.step, "norm": rec.global_norm, "layers": {ls.layer: ls.grad_norm for ls in rec.layers},
        "top": [(t.micro_batch, t.sample, t.position, t.score) for t in top],
        "top_layers": [[(ls.layer, ls.share * t.score) for ls in t.layers] for t in top],
        "total_score": tok.total_score if tok else None, "dropped": tok.dropped_calls if tok else None,
        "unattributed": tok.unattributed_share if tok else None,
        "kinds": sorted(rep.spike.kinds) if rep.incident else [],
        "scope": str(rep.incident.scope) if rep.incident else None,
        "loc": None if loc is None else {
            "status": str(loc.status), "level": str(loc.level), "probes": loc.probes, "note": loc.note,
            "explained": loc.explained_share,
            "culprits": [(c.rank, c.micro_batch, c.sample, c.position) for c in loc.culprits]}}


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


__all__ = ["essentials", "run_steps", "whole"]


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) cross-entropy terms; vocab-parallel (DTensor) logits are made whole first."""
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    Bl, T, V = logits.shape
    return torch.nn.functional.cross_entropy(logits.reshape(Bl * T, V).float(), targets.reshape(Bl * T),
                                             reduction="none").view(Bl, T)  # (B·T,) -> (B, T)


def prepare(model: torch.nn.Module, batches: tuple, plant: tuple | None, dp_rank: int, monitor: bool,
            invariants: bool, watch: dict[str, Any]) -> tuple[torch.optim.Optimizer, Any, Any]:
    """A rank's AdamW, its monitor (warm-up 5; None without ``monitor``) and invariant watch; a plant
    ``(dp rank, step, micro-batch, row, token)`` on this data rank weights that token's loss 3000× in ``batches``'
    weights (``(x, y, w)``, changed in place)."""
    import gradloc
    from tests.distributed.invariants import Watch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if plant is not None and plant[0] == dp_rank:
        _, s, mb, b, t = plant
        batches[2][s, mb, b, t] = 3000.0
    mon = gradloc.watch(model, opt, store=False, detector=gradloc.DetectorConfig(warmup=5), **watch) \
        if monitor else None
    return opt, mon, Watch(mon) if invariants and mon is not None else None


def one_job_incident(ranks: list[dict], step: int, culprit: tuple[int, int, int, str], position: int,
                     text: str | None = None) -> Any:
    """Every rank's ``incidents`` (step, scope, localization) hold one job incident at ``step``, located with
    1–3 probes, whose top culprit is ``(rank, micro-batch, row, sample id)`` at logits ``position`` (the
    corrupted input token; ``position + 1`` may follow it) with ``text``, its share measured against the job's
    gradient; the same answer on every rank. Returns it."""
    locs = []
    for r in ranks:
        assert [(s, str(scope)) for s, scope, _ in r["incidents"]] == [(step, "job")], r["incidents"]
        loc = r["incidents"][0][2]
        assert loc.status == "located" and 1 <= loc.probes <= 3, loc.note
        assert {c.rank for c in loc.culprits} == {culprit[0]}
        top = loc.culprits[0]
        assert (top.rank, top.micro_batch, top.sample, top.sample_id) == culprit
        by_pos = {c.position: c for c in loc.culprits}
        assert position in by_pos and set(by_pos) <= {position, position + 1}, sorted(by_pos)
        if text is not None:
            assert by_pos[position].text == text
        # the share of the job's gradient: the probe gradients combined over the ranks (÷ W as DDP averages);
        # rank-local probes against the averaged gradient would read ~W×
        assert 0.5 < loc.explained_share < 1.1, loc.explained_share
        locs.append(loc)
    assert len({repr(loc) for loc in locs}) == 1  # the same localization on every rank
    return locs[0]
