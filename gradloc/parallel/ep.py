"""Expert parallelism: MoE experts sharded over an expert group (torchtitan: ``GroupedExperts`` parameters as
DTensors on a mesh dim ``ep``, tokens dispatched by an all-to-all ``token_dispatcher``).

Each rank holds E/ep experts and its own tokens (ep is carved out of the data dimension: no model dim; the
experts' replica weights come from their slices like every parameter's). What it owns is the experts'
per-token scores: a token's contribution to expert e's weights is computed where e lives, from the rows the
dispatcher brought there, and belongs to the token's own rank and position. So:

- a wrapper over the dispatcher's ``dispatch`` (an instance attribute; removed at detach) keeps the routing of
  each call: which local row went to which rank (``input_splits``), which rows came from which rank
  (``output_splits``), the expert-major order (``permuted_indices``) and each sent row's token
  (``token_indices_experts_sorted_N``);
- the experts module's own call (x_RD, rows per local expert) is scored row by row in backward with the local
  weights (``rules/routed.py``'s score: the routing weights are already in the rows' gradient) and put back in
  the order the rows arrived;
- at the end of the step, **one all-to-all** over the expert group sends every row's score back to the rank
  its token came from, which adds it at the token's position (a scatter-add over the rows of each token).

Dispatchers other than torchtitan's all-to-all ones (DeepEP, HybridEP): their metadata differs; said once,
the experts unscored (their gradient unattributed).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradloc.collector.rules.grouped_experts import GroupedExpertsRule, weights
from gradloc.collector.rules.routed import ExpertMath, glu, routed_scores
from gradloc.collector.shards import local
from gradloc.parallel.backend import ModelBackend, register_backend
from gradloc.parallel.tp import mesh_dim

log = logging.getLogger("gradloc")


@dataclass
class Routed:
    """One experts call of one micro-batch: its routing, and (after backward) its rows' scores in arrival order."""

    name: str  # the experts module
    layer: int
    send: list[int]  # rows this rank sent to each ep rank (input_splits)
    recv: list[int]  # rows each ep rank sent here (output_splits)
    token_of: torch.Tensor  # (N,) the token of each row sent, in sending order
    permuted: torch.Tensor | None  # (R,) expert-major row p is arrival row permuted[p]
    scores: torch.Tensor | None = None  # (R,) in arrival order, set in backward


@register_backend
class ExpertParallel(ModelBackend):
    name, dim, order = "ep", "ep", 50

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.index = mesh.mesh_dim_names.index("ep")

    @classmethod
    def detect(cls, model: nn.Module, world: Any) -> "ExpertParallel | None":
        if world is None:
            return None
        for p in model.parameters():
            if mesh_dim(p, "ep") is not None:
                return cls(p.device_mesh)
        return None

    def configure_hooks(self, hooks: Any, layout: Any) -> None:
        hooks.routed = EPRouting(self, layout)
        hooks.routed.take_over(hooks)


class EPRouting:
    """The EP side of the token hooks (installed by the backend): capture, and the step's all-to-all."""

    def __init__(self, backend: ExpertParallel, layout: Any) -> None:
        self.backend, self.layout = backend, layout
        self.comm = None  # the ep group's JobComm, made at the first step (the job's world shares its state)
        self._wrapped: list[tuple[Any, nn.Module]] = []  # (dispatcher, the experts it feeds)
        self._pending: dict[int, Any] = {}  # id(experts module) -> the metadata of its last dispatch
        self.said = False

    def take_over(self, hooks: Any) -> None:
        """Experts whose parent dispatches over the ep group are scored here, on their own call."""
        from gradloc.collector.watched import WatchedModule

        rule = EPExpertsRule(self)
        for i, w in enumerate(hooks.watched):
            disp = getattr(w.site, "token_dispatcher", None)
            if isinstance(w.rule, GroupedExpertsRule) and getattr(disp, "ep_mesh", None) is not None:
                hooks.watched[i] = WatchedModule(w.name, w.module, rule, w.layer, w.module)
                self._wrapped.append((disp, w.module))

    def install(self) -> None:
        """Wrap each dispatcher's ``dispatch`` (at attach): its routing metadata is kept for the experts' call."""
        for disp, experts in self._wrapped:
            original = type(disp).dispatch.__get__(disp)

            def dispatch(*args: Any, original: Any = original, experts: nn.Module = experts, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                self._pending[id(experts)] = out[2]  # (routed input, counts, metadata)
                return out

            disp.dispatch = dispatch

    def remove(self) -> None:
        for disp, _ in self._wrapped:
            vars(disp).pop("dispatch", None)
        self._pending.clear()

    def routing(self, experts: nn.Module, name: str, layer: int) -> Routed | None:
        meta = self._pending.pop(id(experts), None)
        if meta is None or not hasattr(meta, "input_splits"):
            if not self.said:
                self.said = True
                log.warning("gradloc: an expert-parallel dispatcher without all-to-all metadata (%s): its experts' "
                            "per-token scores are not computed; their gradient is unattributed", type(meta).__name__)
            return None
        n = int(meta.token_indices_experts_sorted_N.numel())
        return Routed(name, layer, list(meta.input_splits), list(meta.output_splits),
                      meta.token_indices_experts_sorted_N.detach(), getattr(meta, "permuted_indices", None),
                      None) if n == sum(meta.input_splits) else None

    def settle(self, parts: list) -> None:
        """The step's one all-to-all over the expert group: every row's score back to its token's rank and
        position. Every rank issues it every step (the same calls in the same order on each; none: empty)."""
        records = [(meta, buf, r) for meta, buf in parts if buf is not None for r in buf.routed]
        records.sort(key=lambda x: (x[0].index, x[2].layer))
        if self.comm is None:
            self.comm = self.layout.world.sub(self.backend.mesh.get_group(self.backend.index), "ep")
        W = self.comm.world_size
        dev = next((r.token_of.device for _, _, r in records), torch.device("cpu"))
        pieces: list[list[torch.Tensor]] = [[] for _ in range(W)]
        for _, _, r in records:
            rows = r.scores if r.scores is not None else torch.zeros(sum(r.recv), device=dev)
            for d, chunk in enumerate(torch.split(rows.float(), r.recv)):
                pieces[d].append(chunk)
        send = [sum(int(c.numel()) for c in pieces[d]) for d in range(W)]
        recv = [sum(r.send[d] for _, _, r in records) for d in range(W)]
        flat = torch.cat([c for p in pieces for c in p]) if records else torch.zeros(0, device=dev)
        got = self.comm.all_to_all(flat, send, recv, what="gradloc expert scores")
        from_rank = list(torch.split(got, recv))  # per source rank: its rows for every call, in call order
        offsets = [0] * W
        for meta, buf, r in records:
            sent = []
            for d in range(W):
                sent.append(from_rank[d][offsets[d]:offsets[d] + r.send[d]])
                offsets[d] += r.send[d]
            rows = torch.cat(sent)  # (N,): the score of every row this rank sent, in sending order
            per_token = torch.zeros(meta.n_tokens, device=rows.device).index_add_(0, r.token_of.long(), rows)  # (B·T,)
            buf.add(r.layer, per_token)
            if r.scores is not None or sum(r.recv) == 0:
                buf.scored_modules.add(r.name)
        for _, buf, _ in records:
            buf.routed = []


class EPExpertsRule:
    """The experts' own call under EP: rows of every rank's tokens for this rank's experts, scored per row."""

    compilable = False
    takes_over = True  # token_hooks._capture hands the call to ``capture_routed``

    def __init__(self, routing: EPRouting) -> None:
        self.routing = routing

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return tuple(y.shape[:-1])

    def capture_routed(self, w: Any, buf: Any, args: tuple, out: torch.Tensor) -> None:
        r = self.routing.routing(w.module, w.name, w.layer)
        if r is None or len(args) < 2:
            buf.lost_modules.add(w.name)
            return
        x, counts = args[0].detach(), args[1].detach()
        buf.matched_calls += 1
        buf.matched_modules.add(w.name)
        buf.routed.append(r)

        def on_grad(g: torch.Tensor) -> None:
            try:
                with torch.no_grad():
                    s = _row_scores(w.module, x, counts, g)  # (R,) expert-major
                    if r.permuted is not None:
                        s = torch.zeros_like(s).index_copy_(0, r.permuted.long(), s)  # -> arrival order
                    r.scores = s
            except Exception:  # never raise into the training loop
                buf.hook_errors += 1
                log.debug("gradloc: expert-parallel scores failed on %s", w.name, exc_info=True)

        out.register_hook(on_grad)


def _row_scores(module: nn.Module, x: torch.Tensor, counts: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(R,) the score of each row (x (R, D), g (R, D): each row's routing weight already in g) for the local
    experts, rows grouped expert by expert in ``counts`` (e,)."""
    p1, p3, p2 = weights(module)
    w1, w3, w2 = (local(p) for p in (p1, p3, p2))
    F_ = w1.shape[1]
    expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts.long())  # (R,)
    math = ExpertMath(n_experts=w1.shape[0], act=glu(F.silu), down_t=lambda e, d: d @ w2[e],  # (n, D) -> (n, F)
                      up=lambda e, xe: torch.cat([xe.to(w1.dtype) @ w1[e].t(), xe.to(w1.dtype) @ w3[e].t()], -1),
                      down_trains=p2.requires_grad, up_trains=p1.requires_grad or p3.requires_grad,
                      up_sq=lambda eps: eps[:, :F_].float().pow(2).sum(-1) * p1.requires_grad
                      + eps[:, F_:].float().pow(2).sum(-1) * p3.requires_grad)
    return routed_scores(x, expert[:, None], torch.ones(len(expert), 1, device=x.device), g, math)


__all__ = ["EPRouting", "ExpertParallel"]
