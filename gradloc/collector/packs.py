"""Named layouts of the flat float vectors gradloc packs on the device and unpacks on the host.

A step's statistics travel as one vector per step (one host transfer), and a job's ranks exchange
fixed-size rows in one collective: each is a concatenation of segments. :class:`Pack` names them —
``Pack.of(grad_sq=L, grad_max=L, ...)`` — so that code packs with :meth:`Pack.build` and reads with
``pack.get(vector, "grad_sq")``, never with hand-counted offsets (which six files used to keep in step).
``get`` works on a 1-D vector and on rows (the last dim), torch or numpy alike, and on a host list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Pack:
    fields: tuple[tuple[str, int], ...]

    @staticmethod
    def of(**lengths: int) -> "Pack":
        return Pack(tuple((name, int(n)) for name, n in lengths.items()))

    def __len__(self) -> int:
        return sum(n for _, n in self.fields)

    def __add__(self, other: "Pack") -> "Pack":
        return Pack(self.fields + other.fields)

    def span(self, name: str) -> slice:
        pos = 0
        for field, n in self.fields:
            if field == name:
                return slice(pos, pos + n)
            pos += n
        raise KeyError(f"no field {name!r} in {[f for f, _ in self.fields]}")

    def get(self, vector: Any, name: str) -> Any:
        """The field's segment of ``vector`` (the last dim, for rows; a host list's slice for a list)."""
        if isinstance(vector, (list, tuple)):
            return vector[self.span(name)]
        return vector[..., self.span(name)]

    def scalar(self, vector: Any, name: str) -> float:
        return float(self.get(vector, name)[0])

    def segment(self, vector: Any, first: str, last: str) -> Any:
        """The run of fields from ``first`` to ``last`` (inclusive, in layout order) of ``vector``: a sub-layout read
        whole (a ZeRO pack's layer pack, a summed update's sums without their count)."""
        a, b = self.span(first).start, self.span(last).stop
        if b <= a:
            raise KeyError(f"{last!r} does not follow {first!r} in {[f for f, _ in self.fields]}")
        if isinstance(vector, (list, tuple)):
            return vector[a:b]
        return vector[..., a:b]

    def split(self, vector: Any) -> dict[str, Any]:
        """Every field's segment of ``vector`` (of exactly this layout's length), by name: a pack of this layout
        handed to a larger one's :meth:`build`."""
        if vector.shape[-1] != len(self):
            raise ValueError(f"a vector of {vector.shape[-1]} values for a layout of {len(self)}")
        return {name: self.get(vector, name) for name, _ in self.fields}

    def build(self, **parts: torch.Tensor) -> torch.Tensor:
        """The concatenation of ``parts`` in this layout's order, each flattened and checked against its length."""
        out = []
        for name, n in self.fields:
            t = parts[name].reshape(-1)  # (*shape) -> (numel,)
            if t.numel() != n:
                raise ValueError(f"field {name!r} has {t.numel()} values, the layout says {n}")
            out.append(t)
        return torch.cat(out)


def layer_pack(L: int) -> Pack:
    """Per-layer statistics of L layer groups (collector/layer_stats.py): ‖g‖², max |g|, ‖θ‖², whether a
    gradient was present, and the squares of parameters no per-token rule attributes."""
    return Pack.of(grad_sq=L, grad_max=L, param_sq=L, present=L, uncovered_sq=1)


def update_pack(L: int) -> Pack:
    """The previous step's update sums per layer (collector/update_ratio.py): Σ‖Δθ‖², Σ‖θ‖², elements covered."""
    return Pack.of(delta_sq=L, before_sq=L, elements=L)


def summed_update_pack(L: int) -> Pack:
    """A job's update sums (collector/job.py): every rank's :func:`update_pack` summed, then how many ranks had one."""
    return update_pack(L) + Pack.of(ranks=1)


JOB_ROW = Pack.of(loss=1, top=1, total=1)  # a rank's view of its step (collector/job.py), NaN loss = unknown


__all__ = ["JOB_ROW", "Pack", "layer_pack", "summed_update_pack", "update_pack"]
