"""Update-to-weight ratios ‖θ_after − θ_before‖ / ‖θ_before‖ per layer, within a memory budget.

The ratio needs θ_before, a copy of the parameters taken in the optimizer's step pre-hook. A full
copy costs 1× the parameter bytes (14–28 GB on a 7 B model), so by default gradloc copies a
*window*: a run of parameter elements that fits ``window_bytes``, taken in order over the
concatenation of all trainable parameters and moved on by one window every optimizer step. A
sweep ends with the last parameter (its final window may be shorter) and the next one starts over,
so every element is covered exactly once per sweep of about ⌈parameter bytes / window⌉ steps.

- A layer that fits inside one window gets its exact ratio for the step that covered it.
- A layer larger than the window is covered in chunks over consecutive steps; its ratio is
  √(Σ ‖Δ chunk‖² / Σ ‖θ chunk‖²) over the chunks of one sweep, each chunk measured at its own step,
  and is published at the step its last chunk was measured.
- With ``window_bytes=None`` the window is everything (``update_ratio="full"``): every layer, every step.
  ``"lean"`` takes at most 1/``LEAN_SWEEP_STEPS`` (4) of the parameters a step, however much memory it may use:
  a small model's copy, subtraction and reductions of every parameter every step were the largest item of the
  per-layer monitor's time (docs/BENCHMARKS.md §1).

Copies live in one preallocated byte buffer per device (each piece aligned to 64 bytes), so the
persistent memory is the window, not the model. All reductions stay on the device: ``after_step``
returns per-layer sums that travel with the next step's packed host transfer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from gradloc.collector.layer_stats import foreach_norms, local
from gradloc.collector.packs import update_pack

if TYPE_CHECKING:
    from gradloc.collector.layer_stats import LayerStatsCollector
    from gradloc.config import WatchConfig

_ALIGN = 64  # bytes: every piece's copy starts at a multiple of this inside the buffer
_MAX_PLANS = 64


@dataclass(frozen=True)
class Piece:
    param: int  # index into the tracker's parameter list
    start: int  # first element (of the flattened parameter)
    count: int  # elements


@dataclass(frozen=True)
class Window:
    """One step's copy plan: the pieces, and how many elements of each layer they cover."""

    pieces: tuple[Piece, ...]
    layer_elems: np.ndarray  # (L,) float64: elements covered (times their replica weight)


@dataclass
class _Live:
    """A window copied in the pre-hook, waiting for the post-hook."""

    window: Window
    by_device: list[tuple[list[int], list[torch.Tensor], torch.Tensor]]  # (piece idx, copies, layer of each)
    before_sq: list[torch.Tensor]  # per device: (pieces on it,) ‖θ_before piece‖²


class UpdateRatioTracker:
    def __init__(self, params: Sequence[torch.nn.Parameter], group_of: Sequence[int], n_layers: int,
                 window_bytes: int | None, primary: torch.device, weights: Sequence[float] | None = None,
                 layer_numel: Sequence[int] | None = None) -> None:
        """In a job whose sums are summed over the world: ``weights`` (each parameter's replica weight, so
        that replicas count once) and ``layer_numel`` (the job's elements per layer, every stage's)."""
        self.params, self.group_of, self.n_layers = list(params), list(group_of), n_layers
        self.primary = primary
        self.weights = list(weights) if weights is not None else [1.0] * len(self.params)
        self.layer_numel = np.zeros(n_layers, dtype=np.float64)
        if layer_numel is not None:
            self.layer_numel[:] = layer_numel
        else:
            for p, g in zip(self.params, self.group_of):
                self.layer_numel[g] += p.numel()  # a DTensor's global count: shards' sums are summed over ranks
        total = sum(local(p).numel() * p.element_size() for p in self.params)
        self.window_bytes = total if window_bytes is None else max(0, min(int(window_bytes), total))
        self.full = self.window_bytes >= total
        self._cursor = (0, 0)  # (parameter index, element offset) where the next window starts
        self._plans: dict[tuple[int, int], tuple[Window, tuple[int, int]]] = {}
        self._layer_index: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}  # (id(window), device)
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._live: _Live | None = None
        self._acc = np.zeros((3, n_layers))  # Σ‖Δ‖², Σ‖θ‖², elements covered in the current sweep

    @property
    def enabled(self) -> bool:
        return self.window_bytes > 0 and bool(self.params)

    @property
    def sweep_steps(self) -> int:
        """Optimizer steps for the window to cover every parameter once (1 with a full copy)."""
        if not self.enabled:
            return 0
        steps, cursor = 0, (0, 0)
        while True:
            steps += 1
            cursor = (self._plans[cursor] if cursor in self._plans else self._plan(cursor))[1]
            if cursor == (0, 0):
                return steps

    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    # -- the window -----------------------------------------------------------------------------
    def _next_window(self) -> Window:
        start = self._cursor
        plan = self._plans.get(start)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
                self._layer_index.clear()
            plan = self._plans[start] = self._plan(start)
        self._cursor = plan[1]
        return plan[0]

    def _plan(self, start: tuple[int, int]) -> tuple[Window, tuple[int, int]]:
        pieces, left = [], self.window_bytes
        i, off = start
        elems = np.zeros(self.n_layers, dtype=np.float64)
        for _ in range(2 * len(self.params) + 1):
            p = local(self.params[i])
            es, rest = p.element_size(), p.numel() - off
            take = min(rest, left // es) if pieces or left >= es else min(rest, 1)  # ≥ 1 element a step
            if take <= 0:
                break
            pieces.append(Piece(i, off, take))
            elems[self.group_of[i]] += take * self.weights[i]  # replicas' elements count once
            left -= take * es
            off += take
            if off >= p.numel():
                i, off = (i + 1) % len(self.params), 0
                if i == 0:
                    break  # the sweep ends with the parameter list: the next window starts a new one
            if left <= 0:
                break
        return Window(tuple(pieces), elems), (i, off)

    def _copies(self, device: torch.device, pieces: list[Piece]) -> list[torch.Tensor]:
        """Views into the device's buffer, one per piece (grown once if this window needs more)."""
        offsets, size = [], 0
        for pc in pieces:
            offsets.append(size)
            size += -(-pc.count * self.params[pc.param].element_size() // _ALIGN) * _ALIGN
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < size:
            buf = self._buffers[device] = torch.empty(size, dtype=torch.uint8, device=device)
        out = []
        for pc, o in zip(pieces, offsets):
            p = self.params[pc.param]
            out.append(buf[o:o + pc.count * p.element_size()].view(p.dtype))  # (bytes,) -> (count,)
        return out

    def _layers_of(self, window: Window, dev: torch.device, pieces: list[Piece]) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer of each piece, its replica weight) on ``dev``, cached per window."""
        key = (id(window), dev)
        got = self._layer_index.get(key)
        if got is None:
            got = self._layer_index[key] = (
                torch.tensor([self.group_of[pc.param] for pc in pieces], dtype=torch.long, device=dev),
                torch.tensor([self.weights[pc.param] for pc in pieces], device=dev))
        return got

    def _sources(self, pieces: Sequence[Piece]) -> list[torch.Tensor]:
        return [local(self.params[pc.param]).detach().reshape(-1)[pc.start:pc.start + pc.count]  # (*shape) -> (numel,)
                for pc in pieces]

    # -- optimizer hooks ------------------------------------------------------------------------
    def before_step(self) -> None:
        """Pre-hook: copy this step's window of θ_before."""
        if not self.enabled:
            return
        window = self._next_window()
        groups: dict[torch.device, list[int]] = {}
        for j, pc in enumerate(window.pieces):
            groups.setdefault(local(self.params[pc.param]).device, []).append(j)
        by_device, before = [], []
        for dev, idx in groups.items():
            pieces = [window.pieces[j] for j in idx]
            dst = self._copies(dev, pieces)
            torch._foreach_copy_(dst, self._sources(pieces))
            before.append(foreach_norms(dst).pow(2))  # (pieces,)
            by_device.append((idx, dst, self._layers_of(window, dev, pieces)))
        self._live = _Live(window, by_device, before)

    def after_step(self) -> tuple[Window, torch.Tensor] | None:
        """Post-hook: the window and its per-layer sums (``packs.update_pack``: Σ‖Δ‖², Σ‖θ_before‖², elements
        covered) on the primary device (sharded: this rank's, to be summed over ranks)."""
        live, self._live = self._live, None
        if live is None:
            return None
        L = self.n_layers
        up = update_pack(L)
        out = torch.zeros(len(up), device=self.primary)
        up.get(out, "elements")[:] = torch.from_numpy(live.window.layer_elems.astype(np.float32)).to(self.primary)
        for (idx, dst, (layer, w)), before_sq in zip(live.by_device, live.before_sq):
            pieces = [live.window.pieces[j] for j in idx]
            torch._foreach_sub_(dst, self._sources(pieces))  # θ_before − θ_after
            delta_sq = foreach_norms(dst).pow(2)  # (pieces,)
            part = torch.zeros(len(up), device=layer.device)
            up.get(part, "delta_sq").index_add_(0, layer, delta_sq * w)
            up.get(part, "before_sq").index_add_(0, layer, before_sq * w)
            out += part.to(self.primary, non_blocking=True)
        return live.window, out

    # -- host side --------------------------------------------------------------------------------
    def ratios(self, sums: np.ndarray) -> np.ndarray:
        """(L,) ratios from one window's host sums ``[Σ‖Δ‖² | Σ‖θ‖² | elements]`` (the job's, summed
        over ranks, when sharded); NaN where no layer's sweep completed this step."""
        L = self.n_layers
        up = update_pack(L)
        out = np.full(L, np.nan)
        elems = up.get(sums, "elements")
        covered = elems > 0
        self._acc[0, covered] += up.get(sums, "delta_sq")[covered]
        self._acc[1, covered] += up.get(sums, "before_sq")[covered]
        self._acc[2, covered] += elems[covered]
        done = covered & (self._acc[2] >= self.layer_numel * (1 - 1e-5))  # float32 counts, weighted replicas
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.sqrt(self._acc[0] / self._acc[1])
        out[done] = np.where(self._acc[1][done] > 0, ratio[done], np.nan)
        self._acc[:, done] = 0.0
        return out

    def release(self) -> None:
        self._buffers.clear()
        self._layer_index.clear()
        self._live = None


def window_bytes(config: "WatchConfig", layer_stats: "LayerStatsCollector") -> int | None:
    """Bytes of the update-ratio window: None (everything) for "full", else the memory budget less
    gradloc's other persistent device tensors and a reserve for its other state, and at most
    1/``LEAN_SWEEP_STEPS`` of the parameters (a sweep of at least that many steps)."""
    from gradloc.config import LEAN_SWEEP_STEPS, MEMORY_BUDGET_FRACTION, MEMORY_RESERVE, MIN_MEMORY_BUDGET

    mode = config.update_ratio
    if mode == "full":
        return None
    if mode == "off":
        return 0
    budget = config.memory_budget_bytes
    if budget is None:
        budget = max(int(MEMORY_BUDGET_FRACTION * layer_stats.param_bytes()), MIN_MEMORY_BUDGET)
    reserve = min(MEMORY_RESERVE, budget // 4)
    n_params = len(layer_stats.params)
    fits = max(budget - reserve - layer_stats.persistent_bytes() - 64 * n_params, 0)  # 64: alignment per piece
    return min(fits, -(-layer_stats.param_bytes() // LEAN_SWEEP_STEPS))
