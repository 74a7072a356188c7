"""``WatchConfig(token_stats="on_spike")``: no module hook on healthy steps; on a flagged step the
per-token statistics come from re-running that step's micro-batches with the hooks on.

For what hooks cannot run inside — a CUDA graph replaying forward + backward (torchtitan records one
from step 2), fused kernels, a ``fullgraph`` region someone else compiled — and for anyone who wants
per-layer cost only on healthy steps. A healthy step then costs what per-layer statistics cost: the
gradients are read after backward, one host transfer per step, nothing inside the captured region.

On a step that opens an incident the localizer runs on (every rank of a job together: the spike is
the job's), each micro-batch is re-run eagerly through the probe closure with every token's loss
term on and the hooks attached, inside a session of the step's one probe scope (``Job.scope``: the
job's probe context, the training gradient set aside, buffers and RNG restored,
each micro-batch's RNG as it was in training), so its scores are the scores an always-on run
would have had. Compiled code runs eagerly for the re-run (``torch.compiler.set_stance
("force_eager")``), so the hooks fire even where the training step is compiled or captured. Then
localization goes on as always (≤ ``max_probes`` probes); the M re-run passes are reported apart
from the probes, in ``Localization.passes`` and the note.

One process and DDP (the re-runs in ``no_sync``). Not under FSDP2 or DeepSpeed, where every forward
is a collective over ranks holding different numbers of micro-batches: refused at ``watch()``.
Without token statistics on healthy steps there is no ``token_spike``, no ``sample_spike`` and no
per-sample surprise finding; ``grad_spike``, ``loss_spike`` and the non-finite kinds run as usual.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import Any, Callable, ContextManager, Sequence

import torch

from gradloc.collector.batch import MicroBatchMeta
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.collector.token_hooks import TokenHooks
from gradloc.localizer.scope import Scope
from gradloc.records import Incident

log = logging.getLogger("gradloc")

MODE = "on_spike"


def rerun(hooks: TokenHooks, scope: Scope, metas: Sequence[MicroBatchMeta], breakdown: bool,
          labels: Callable[[MicroBatchMeta], Any]) -> list[tuple[MicroBatchMeta, MicroBatchScores]] | None:
    """(meta, scores) of every micro-batch of the step, re-run with the hooks on through the step's probe
    scope (``scope.session(hooks=True)``: the job's probe context, the model, its gradients, buffers and RNG
    as they were). None when a re-run failed (logged): the step then has no per-token statistics rather
    than a partial picture that would misattribute."""
    parts: list[tuple[MicroBatchMeta, MicroBatchScores]] = []
    hooks.attach()
    try:
        with _eager(), scope.session(hooks=True) as session:
            for meta in metas:
                hooks.begin(meta.index, meta.batch, meta.seq, breakdown, labels=labels(meta))
                try:
                    session.grad(meta.index, torch.ones(meta.batch, meta.seq, dtype=torch.bool))
                finally:
                    buf = hooks.end()
                parts.append((meta, buf))
    except Exception:  # noqa: BLE001 - never raise into training
        log.warning("gradloc: on_spike re-run of the step's micro-batches failed", exc_info=True)
        return None
    finally:
        hooks.detach()
    return parts


def with_reruns(inc: Incident, n: int) -> Incident:
    """The incident with the ``n`` re-run passes counted apart from the probes (passes and note)."""
    loc = inc.localization
    if loc is None:
        return inc
    note = f"on_spike: the step's {n} micro-batch(es) re-run with hooks for its per-token statistics"
    return replace(inc, localization=replace(loc, passes=loc.passes + n, note=f"{note}; {loc.note}" if loc.note else note))


def _eager() -> ContextManager[Any]:
    """Compiled functions run their Python code (so module hooks fire), where torch has the stance."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


__all__ = ["MODE", "rerun", "with_reruns"]
