"""One localization's shared state on one rank, and the one place its probes run and are counted.

The localizer's levels — the token rounds and their growth (``localizer.py``), pruning and naming (``prune.py``,
``naming.py``), below the tokens (``below.py``, ``ranks.py``), bisection (``bisect_step.py``) — all work through
a :class:`Runner`: its view, stored gradient, context and scope; :meth:`Runner.probe_round` (this rank's probe of
one token group, or its empty part in a lockstep round); :meth:`Runner.spend`, the one place the ≤ ``max_probes``
budget is counted; :meth:`Runner.verified`, the verification test; and the records every rank builds and
gathers. The levels import this module, never ``localizer.py`` (no import cycle inside ``localizer/``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import numpy as np
import torch
from torch import nn

from gradloc.config import LocalizerConfig
from gradloc.localizer.context import SpikeContext, StoredGradient, loss_fields, probe_into, verified
from gradloc.localizer.picture import Picture, merge_samples, summary, top_samples
from gradloc.localizer.probes import Grads, ProbeSession
from gradloc.localizer.scope import Scope, SoloComm
from gradloc.localizer.spans import Decode, build_culprits, build_spans
from gradloc.localizer.token_view import TokenView
from gradloc.records import Level, Localization, Method, Status


class Runner:
    """One localization on one rank (the others run theirs in lockstep)."""

    session: ProbeSession  # set while the scope's probe session is open (Localizer's driver)

    def __init__(self, cfg: LocalizerConfig, decode: Decode | None, step: int, view: TokenView | None,
                 stored: StoredGradient, scope: Scope | None, ctx: SpikeContext, head: nn.Module | None,
                 keep_grad: bool, has_probe: bool) -> None:
        self.cfg, self.decode, self.step, self.view, self.stored, self.scope = cfg, decode, step, view, stored, scope
        self.ctx, self.head, self.keep_grad = ctx, head, keep_grad
        self.comm = scope.comm if scope is not None else SoloComm()
        self.W, self.rank = self.comm.world_size, self.comm.rank
        self._used = 0  # probes so far (the same on every rank): spend() is the one place it changes
        K = self.cfg.max_candidates
        self.pic = Picture(rows=self.comm.all_gather(summary(view, K, has_probe), "gradloc candidates").numpy(), K=K)

    @property
    def solo(self) -> bool:
        """One process, not a job's rank (a job of one rank still names its rank and never bisects)."""
        return not getattr(self.scope, "job", False)

    @contextlib.contextmanager
    def probing(self) -> Iterator[ProbeSession]:
        """The scope's probe session, open as ``session`` for the levels while the block runs."""
        with self.scope.session() as session:
            self.session = session
            yield session

    # -- the probe budget and the verification test ----------------------------------------------
    @property
    def used(self) -> int:
        """Probes spent so far (a probe: one round of every rank's probes, or a rank's micro-batches together)."""
        return self._used

    @property
    def left(self) -> int:
        return self.cfg.max_probes - self._used

    def spend(self) -> None:
        """Count one probe against ``max_probes`` (every rank counts it: the same path everywhere)."""
        self._used += 1

    def verified(self, explained: float, loss_c: float = 0.0) -> bool:
        """The verification test (``context.verified``) of a set explaining ``explained`` of ‖∇‖², with loss ℓ_C."""
        return verified(self.cfg.min_explained_share, explained, self.stored.norm, loss_c, self.ctx)

    # -- probes -----------------------------------------------------------------------------------
    def probe_round(self, acc: Grads, group: tuple[int, np.ndarray] | None) -> tuple[Grads, str]:
        """One round: this rank probes ``group`` (view position, flats) or, in lockstep, nothing."""
        view, session = self.view, self.session
        if group is not None:
            try:
                return probe_into(session, view, acc, group[0], group[1]), ""
            except Exception as exc:  # noqa: BLE001 - the other ranks must not wait on this rank
                if self.solo or self.scope.lockstep:
                    raise  # one process: nothing waits; lockstep: its collectives fail on every rank
                return acc, f"the probe on rank {self.rank} failed: {type(exc).__name__}: {exc}"
        if self.scope.lockstep:  # a collective: take part with nothing to probe
            meta = view.metas[0]
            acc = session.add_to(acc, meta.index, view.mask(0))
            session.losses.pop()
        return acc, ""

    # -- records ----------------------------------------------------------------------------------
    def gather_records(self, flats: list[int], shares: list[float], with_spans: bool = True) -> tuple:
        """(culprits, spans, samples) of the job: each rank's own, gathered (rank named when W > 1)."""
        from dataclasses import replace as _replace

        view, dec = self.view, self.decode
        culprits = build_culprits(view, flats, shares, dec)
        spans = build_spans(view, culprits, dec, self.cfg.context_tokens) if with_spans else ()
        if not self.solo:
            culprits = tuple(_replace(c, rank=self.rank) for c in culprits)
            spans = tuple(_replace(x, rank=self.rank) for x in spans)
        every = self.comm.all_gather_object((culprits, spans, top_samples(view)), "gradloc culprit records")
        key = lambda x: -x.share if math.isfinite(x.share) else 0.0  # noqa: E731
        return (tuple(sorted((c for e in every for c in e[0]), key=key)),
                tuple(sorted((x for e in every for x in e[1]), key=key)),
                merge_samples([e[2] for e in every], self.pic.total_score, not self.solo))

    def record(self, *, method: Method, status: Status, level: Level = Level.NONE, probes: int, culprits=(),
               spans=(), samples=(), note: str = "", explained: float | None = None,
               norms: tuple[float | None, float | None] = (None, None), loss: float | None = None,
               passes: int = 0, groups=()) -> Localization:
        ls, lw = loss_fields(self.ctx, loss) if loss is not None else (None, None)
        return Localization(step=self.step, method=method, status=status, level=level, probes=probes, passes=passes,
                            explained_share=explained, global_norm=self.stored.norm, culprit_norm=norms[0],
                            norm_without_culprits=norms[1], culprits=culprits, spans=spans,
                            micro_batch_shares=self.view.micro_batch_shares() if self.solo else (),
                            unattributed_share=self.view.unattributed_share, loss_share=ls,
                            loss_without_culprits=lw, note=note, samples=samples, groups=groups)

    def all_ranks(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank (one collective in a job)."""
        if self.solo:
            return flag
        return not self.comm.all_reduce(torch.tensor([0.0 if flag else 1.0]), op="max", what="gradloc agree")[0]

    def n_samples(self) -> int:
        mine = sum(m.n_samples for m in self.view.metas)
        return mine if self.solo else int(self.comm.all_reduce(torch.tensor([float(mine)], dtype=torch.float64),
                                                               what="gradloc samples")[0])

    def empty(self, method: Method, status: Status, probes: int, note: str, samples: tuple = (),
              passes: int = 0) -> Localization:
        """A localization with no culprit (unavailable, diffuse), on this run's step, view and norm."""
        return empty(self.step, method, status, probes, self.stored.norm, self.view, note, samples, passes,
                     self.solo)


def empty(step: int, method: Method, status: Status, probes: int, norm: float, view: TokenView | None,
          note: str, samples: tuple = (), passes: int = 0, solo: bool = True) -> Localization:
    return Localization(step=step, method=method, status=status, probes=probes, passes=passes, global_norm=norm,
                        micro_batch_shares=view.micro_batch_shares() if view is not None and solo else (),
                        unattributed_share=view.unattributed_share if view is not None else 0.0, note=note,
                        samples=samples)


__all__ = ["Runner", "empty"]
