"""Rows that look like quarantined ones: the quarantine extended from the rows gradloc flagged to the rows of the
same systematic content fault that it never got to flag.

A fault that is a property of content — a file read with the wrong encoding, binary blobs in a text shard, the same
boilerplate scraped a thousand times — puts many rows in a dataset, and the model often learns it from the first
few: the rows it meets later are no longer surprising, and gradloc flags only the early ones (docs/BENCHMARKS.md
§7: UTF-16 text read as bytes, learned within ~30 steps). Those rows still *look* like the flagged ones, and the
loader has their content. So, with no model and no training step:

- each row's **token mix** is its unigram histogram of token ids (ids hashed into ``buckets`` bins, L2-normalised:
  order and length do not matter, what the row is made of does);
- a row's **atypicality** is how far its mix is from its source's mean mix: z = (median − cos) / (1.4826 · MAD)
  over the source's rows (robust: a few percent of faulty rows barely move it);
- a quarantined row (by sample id or origin) whose own mix is atypical (z ≥ ``min_atypical_z``) is a **seed**; a
  quarantined row whose content is typical (wrong labels on normal text, a culprit of a gradient spike) seeds
  nothing: its look-alikes would be ordinary rows;
- a row that is not quarantined is a **look-alike** when it is atypical of its own source too and its mix is
  within cosine ``min_similarity`` of a seed's, in any source (an encoding bug in the pipeline hits every source).

On the benchmark's mixture, UTF-16 rows are 0.96–0.99 alike and clean rows at most 0.66 alike to them. What it
does not catch: faults that leave the content ordinary (labels that are the inputs, a wrong answer in a well-formed
sample). Each look-alike becomes an entry whose reason names the seed, its similarity and atypicality;
``QuarantineList.with_lookalikes`` returns the list with them (``save`` it, ``gradloc-agent quarantine import`` it
into the store so the team's next run has them too).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Key = tuple[str | None, str | None, str | None]  # (sample id, origin, source) of one row
_CHUNK = 4096  # rows profiled at a time: memory is _CHUNK × buckets floats, whatever the dataset's size


@dataclass(frozen=True, kw_only=True)
class LookalikeConfig:
    min_similarity: float = 0.9  # cosine of token mixes, to a seed
    min_atypical_z: float = 4.0  # robust z of a row's distance from its source's mean mix (seeds and look-alikes)
    buckets: int = 4096  # token ids are hashed (id mod buckets) into this many bins; a byte vocabulary is exact

    def __post_init__(self) -> None:
        if not 0.0 < self.min_similarity <= 1.0:
            raise ValueError(f"min_similarity must be in (0, 1], got {self.min_similarity!r}")
        if not self.min_atypical_z > 0:
            raise ValueError(f"min_atypical_z must be > 0, got {self.min_atypical_z!r}")
        if not isinstance(self.buckets, int) or self.buckets < 2:
            raise ValueError(f"buckets must be an int >= 2, got {self.buckets!r}")


@dataclass(frozen=True, kw_only=True)
class Lookalike:
    index: int  # the row's index in the rows given
    key: Key
    like: int  # the seed row's index
    similarity: float
    atypical_z: float


def profiles(rows: Sequence[Sequence[int]], buckets: int) -> np.ndarray:
    """(len(rows), buckets) float32: each row's L2-normalised histogram of ids mod ``buckets`` (negative ids, such
    as −100 padding, do not count; an empty row is all zeros)."""
    out = np.zeros((len(rows), buckets), dtype=np.float32)
    for i, row in enumerate(rows):
        ids = np.asarray(row, dtype=np.int64).ravel()  # any shape of one row's ids -> (T,)
        ids = ids[ids >= 0]
        if ids.size:
            out[i] = np.bincount(ids % buckets, minlength=buckets)
    norm = np.linalg.norm(out, axis=1, keepdims=True)  # (n, 1)
    return out / np.where(norm > 0, norm, 1.0)


def _chunks(n: int) -> list[range]:
    return [range(a, min(a + _CHUNK, n)) for a in range(0, n, _CHUNK)]


def atypicality(rows: Sequence[Sequence[int]], sources: Sequence[str | None], buckets: int) -> np.ndarray:
    """(n,) each row's robust z of its distance from its source's mean token mix (module docstring)."""
    n = len(rows)
    groups = sorted({s for s in sources}, key=lambda s: (s is None, s or ""))
    gid = np.array([groups.index(s) for s in sources]) if n else np.zeros(0, dtype=int)  # (n,)
    centre = np.zeros((len(groups), buckets))
    for part in _chunks(n):
        np.add.at(centre, gid[part.start:part.stop], profiles([rows[i] for i in part], buckets))
    centre /= np.maximum(np.linalg.norm(centre, axis=1, keepdims=True), 1e-12)
    cos = np.empty(n)
    for part in _chunks(n):
        p = profiles([rows[i] for i in part], buckets)
        cos[part.start:part.stop] = np.einsum("nb,nb->n", p, centre[gid[part.start:part.stop]])  # (n,)
    z = np.zeros(n)
    for g in range(len(groups)):
        members = gid == g
        med = float(np.median(cos[members]))
        mad = 1.4826 * float(np.median(np.abs(cos[members] - med)))
        z[members] = (med - cos[members]) / max(mad, 1e-3)
    return z


def find(rows: Sequence[Sequence[int]], keys: Sequence[Key], quarantined: Callable[[Key], bool],
         cfg: LookalikeConfig = LookalikeConfig()) -> tuple[Lookalike, ...]:
    """The rows that look like quarantined rows (module docstring). ``rows[i]``: row i's token ids; ``keys[i]``:
    its (sample id, origin, source); ``quarantined(key)``: whether a sample id or origin entry holds that row."""
    if len(rows) != len(keys):
        raise ValueError(f"rows ({len(rows)}) and keys ({len(keys)}) must have the same length")
    z = atypicality(rows, [k[2] for k in keys], cfg.buckets)
    held = np.array([quarantined(k) for k in keys], dtype=bool)
    seeds = np.flatnonzero(held & (z >= cfg.min_atypical_z))
    if not seeds.size:
        return ()
    seed_mix = profiles([rows[i] for i in seeds], cfg.buckets)  # (n_seeds, buckets)
    found = []
    for part in _chunks(len(rows)):
        idx = np.array([i for i in part if not held[i] and z[i] >= cfg.min_atypical_z], dtype=int)
        if not idx.size:
            continue
        sim = profiles([rows[i] for i in idx], cfg.buckets) @ seed_mix.T  # (candidates, n_seeds)
        best = sim.argmax(axis=1)
        for j, i in enumerate(idx):
            s = float(sim[j, best[j]])
            if s >= cfg.min_similarity:
                found.append(Lookalike(index=int(i), key=keys[i], like=int(seeds[best[j]]), similarity=s,
                                       atypical_z=float(z[i])))
    return tuple(found)


__all__ = ["Lookalike", "LookalikeConfig", "atypicality", "find", "profiles"]
