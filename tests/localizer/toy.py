"""The localizer tests' exact toy (the records the tests build come from tests/builders.py).

An exact toy for the per-rank localizer (:class:`Toy`): one parameter w (D,); micro-batch i holds token vectors
V[i] (B, T, D), and the probe closure ``probe(i, mask) = w · Σ_{masked t} v_t`` has gradient Σ_{masked t} v_t.
The training gradient, every probe's gradient and loss, and each token's exact attribution score ‖v_t‖² are
known in closed form. The toy works in float64 on integer-valued vectors, so every sum of token vectors is exact.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from gradloc.collector.batch import make_meta
from gradloc.localizer.localizer import SpikeContext, StoredGradient
from gradloc.localizer.probes import ProbeFn, ProbeSession
from gradloc.localizer.scope import SoloScope
from gradloc.localizer.token_view import TokenView


# -- the exact toy --------------------------------------------------------------------------------------
def basis(d: int, k: int, scale: float = 1.0) -> torch.Tensor:
    """scale · e_k in R^d (float64)."""
    v = torch.zeros(d, dtype=torch.float64)
    v[k] = scale
    return v


class ToyModel(nn.Module):
    def __init__(self, d: int, w: Sequence[float] | torch.Tensor | None = None) -> None:
        super().__init__()
        init = torch.ones(d, dtype=torch.float64) if w is None else torch.as_tensor(w, dtype=torch.float64).clone()
        self.w = nn.Parameter(init)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))  # a buffer a closure may mutate


class Toy:
    """M micro-batches of B samples × T positions; flat index = m·B·T + b·T + t.

    ``V`` (M, B, T, D); positions where ``eligible`` is False carry no loss term (their vectors are
    zeroed, as a real loss mask would). Micro-batch position m has the user's index ``first + m``;
    token ids are 100 + flat index unless given.
    """

    def __init__(self, V: torch.Tensor, eligible: torch.Tensor | None = None,
                 w: Sequence[float] | torch.Tensor | None = None, first: int = 0,
                 sample_ids: Sequence[Sequence[str]] | None = None) -> None:
        M, B, T, D = V.shape
        self.M, self.B, self.T, self.D, self.first = M, B, T, D, first
        self.eligible = torch.ones(M, B, T, dtype=torch.bool) if eligible is None else eligible.to(torch.bool)
        self.V = V.to(torch.float64) * self.eligible[..., None]
        self.model = ToyModel(D, w)
        self.w = self.model.w
        ids = torch.arange(M * B * T).reshape(M, B, T) + 100  # (N,) -> (M, B, T)
        self.metas = tuple(make_meta(first + m, ids[m], self.eligible[m], sample_ids[m] if sample_ids else None, None)
                           for m in range(M))
        self.opens = 0

    # -- the closure and the closed-form references -----------------------------------------------
    def probe(self, i: int, mask: torch.Tensor) -> torch.Tensor:
        Vi = self.V[i - self.first]  # (B, T, D)
        return (self.w * (Vi * mask[..., None]).sum((0, 1))).sum()  # w · Σ_t mask_t v_t

    def flat(self, m: int, b: int, t: int) -> int:
        return (m * self.B + b) * self.T + t

    def grad_of(self, flats: Sequence[int] | None = None) -> torch.Tensor:
        """Σ v_t over ``flats`` (all tokens when None): float64 (D,)."""
        rows = self.V.reshape(-1, self.D)  # (M, B, T, D) -> (N, D)
        return rows.sum(0) if flats is None else rows[list(flats)].sum(0)

    def share_of(self, flats: Sequence[int]) -> float:
        """⟨∇_S, ∇⟩ / ‖∇‖²."""
        g = self.grad_of()
        return float(self.grad_of(flats) @ g / (g @ g))

    def norm(self, without: Sequence[int] = ()) -> float:
        """‖∇ − ∇_S‖ for S = ``without``."""
        g = self.grad_of()
        return float((g - self.grad_of(without)).norm() if without else g.norm())

    def loss_of(self, flats: Sequence[int] | None = None) -> float:
        return float(self.w.detach() @ self.grad_of(flats))

    # -- what the localizer is handed -------------------------------------------------------------
    def scores(self) -> np.ndarray:
        return (self.V.reshape(-1, self.D) ** 2).sum(1).numpy()  # (M, B, T, D) -> (N, D) -> (N,) ‖v_t‖²

    def view(self, scores: np.ndarray | None = None, unattributed: float = 0.0,
             exact: np.ndarray | None = None) -> TokenView:
        n = self.B * self.T
        return TokenView((), self.metas, tuple(range(0, (self.M + 1) * n, n)),
                         self.scores() if scores is None else np.asarray(scores, dtype=np.float64), None,
                         self.eligible.reshape(-1).numpy(), unattributed, None, exact)  # (M, B, T) -> (N,)

    def stored(self, scale: float = 1.0) -> StoredGradient:
        """The training gradient as the optimizer sees it (× ``scale``, like a GradScaler's)."""
        return StoredGradient([self.grad_of() * scale], 1.0 / scale, self.norm())

    def scope(self, stored: StoredGradient | None = None, closure: ProbeFn | None = None) -> SoloScope:
        """One process's probe scope over ``stored`` (default: the toy's own gradient)."""
        st = stored if stored is not None else self.stored()
        return SoloScope(self.opener(closure), st.grads, st.inv_scale, st.norm)

    def opener(self, closure: ProbeFn | None = None) -> Callable[[bool], ProbeSession]:
        def open_probes(hooks: bool = False) -> ProbeSession:
            self.opens += 1
            return ProbeSession(self.model, [self.w], self.metas, closure or self.probe, suspend=lambda on: None)

        return open_probes


def planted(plants: dict[tuple[int, int, int], torch.Tensor], M: int = 3, B: int = 2, T: int = 4, D: int = 8,
            noise: float = 1.0, **kw) -> Toy:
    """Every token is ``noise``·e_0 (aligned noise: n tokens sum to norm n·noise, score noise² each)
    except the planted ones, {(m, b, t): vector}."""
    V = torch.zeros(M, B, T, D, dtype=torch.float64)
    V[..., 0] = noise
    for (m, b, t), v in plants.items():
        V[m, b, t] = torch.as_tensor(v, dtype=torch.float64)
    return Toy(V, **kw)


def ctx(healthy: float | None = None, std: float | None = None, loss: float | None = None,
        healthy_loss: float | None = None, z: float = 2.5, line: float | None = None) -> SpikeContext:
    """The toys' context: the spike line is ``line``, else healthy + z·std (no std: no line)."""
    if line is None and healthy is not None and std is not None:
        line = healthy + z * std
    band = healthy + z * std if healthy is not None and std is not None else None
    return SpikeContext(healthy_norm=healthy, loss=loss, healthy_loss=healthy_loss, spike_line=line, band_line=band)
