"""Keep quarantined data out of a resumed run: the loader side of ``gradloc-agent quarantine``.

    q = QuarantineList.load("quarantine.jsonl")          # gradloc-agent quarantine export quarantine.jsonl
    train = q.filter_dataset(with_provenance(ds, source="web"), id_column="uid")   # HF datasets
    loader = DataLoader(ds, sampler=QuarantineSampler(RandomSampler(ds), q, key=lambda i: ds.provenance(i)))

A row is skipped when its sample id, its origin or its source is on the list (the columns ``with_provenance``
adds, ``integrations/provenance.py``). Both helpers count what they skipped (``skipped``, by kind) and refuse —
with a clear error — a list that would leave no sample: a loader that trains on nothing is never the answer.
Lines of the list that are not entries (malformed JSON, an unknown kind, a value past its limit) are skipped,
counted in ``QuarantineList.bad_lines`` and logged, never guessed.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradloc.integrations.provenance import ORIGIN, SOURCE
from gradloc.records import QuarantineEntry, QuarantineKind, to_dict

log = logging.getLogger("gradloc")
Key = tuple[str | None, str | None, str | None]  # (sample id, origin, source) of one sample


class EverySampleQuarantined(ValueError):
    """The quarantine would remove every sample of the data it filters."""


@dataclass
class QuarantineList:
    entries: tuple[QuarantineEntry, ...] = ()
    bad_lines: int = 0  # lines of the loaded list that were not valid entries (logged)
    skipped: Counter[str] = field(default_factory=Counter)  # samples a helper left out, by the kind that matched

    def __post_init__(self) -> None:
        by = {k: frozenset(e.value for e in self.entries if e.kind == k) for k in QuarantineKind}
        self._samples, self._origins, self._sources = by[QuarantineKind.SAMPLE], by[QuarantineKind.ORIGIN], \
            by[QuarantineKind.SOURCE]

    @classmethod
    def load(cls, path: str | Path) -> QuarantineList:
        """The list a ``gradloc-agent quarantine export`` wrote (one JSON entry per line)."""
        return cls.parse(Path(path).read_text(encoding="utf-8").splitlines())

    @classmethod
    def from_store(cls, path: str | Path) -> QuarantineList:
        """The list in an incident store (a SQLite file the daemon writes; it is not created when missing)."""
        from gradloc.store import IncidentStore

        with IncidentStore(path, create=False) as store:
            return cls.parse(json.dumps(to_dict(e)) for e in store.quarantine.list())

    @classmethod
    def from_agent(cls, address: str, token: str | None = None, timeout_s: float = 30.0) -> QuarantineList:
        """The list a running daemon holds (``GET /api/quarantine`` at its ``--http`` address, ``host:port`` or a
        URL; ``token``: its bearer token). Raises ``OSError`` when it does not answer: call it before training."""
        import urllib.request

        base = address if "://" in address else f"http://{address}"
        req = urllib.request.Request(base.rstrip("/") + "/api/quarantine",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            rows = json.loads(resp.read().decode("utf-8"))
        return cls.parse(json.dumps(row) for row in rows)

    @classmethod
    def parse(cls, lines: Iterable[str]) -> QuarantineList:
        entries, bad = [], 0
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                entries.append(QuarantineEntry(kind=d["kind"], value=d["value"], reason=d.get("reason", ""),
                                               added_unix=float(d.get("added_unix", 0.0)), job=d.get("job"),
                                               step=d.get("step"), incident_id=d.get("incident_id")))
            except (ValueError, KeyError, TypeError) as exc:
                bad += 1
                log.warning("gradloc: quarantine line %d is not an entry (%s); skipped", n, exc)
        return cls(tuple(entries), bad_lines=bad)

    def match(self, sample_id: str | None = None, origin: str | None = None, source: str | None = None) -> str | None:
        """The kind of entry that keeps this sample out (None: it stays)."""
        if sample_id is not None and str(sample_id) in self._samples:
            return QuarantineKind.SAMPLE.value
        if origin is not None and origin in self._origins:
            return QuarantineKind.ORIGIN.value
        if source is not None and source in self._sources:
            return QuarantineKind.SOURCE.value
        return None

    def filter_dataset(self, dataset: Any, id_column: str | None = None) -> Any:
        """A ``datasets.Dataset`` without its quarantined rows (by ``id_column`` and the provenance columns)."""
        cols = set(dataset.column_names)
        keys = [dataset[c] if c is not None and c in cols else [None] * len(dataset)
                for c in (id_column, ORIGIN, SOURCE)]
        kept, hits = [], Counter()
        for i, key in enumerate(zip(*keys)):
            hit = self.match(*key)
            if hit is None:
                kept.append(i)
            else:
                hits[hit] += 1
        self._account(hits, len(dataset), len(kept))
        return dataset.select(kept) if len(kept) < len(dataset) else dataset

    def _account(self, hits: Counter[str], total: int, kept: int) -> None:
        if total and not kept:
            raise EverySampleQuarantined(f"the quarantine ({len(self.entries)} entries) would remove all {total} "
                                         f"samples ({dict(hits)}); refusing to train on nothing")
        self.skipped.update(hits)
        if hits:
            log.info("gradloc: quarantine left out %d of %d samples (%s)", total - kept, total, dict(hits))


class QuarantineSampler:
    """A sampler (any iterable of dataset indices) without the quarantined indices: ``key(i)`` gives index i's
    (sample id, origin, source). Checked once over every index of the dataset at construction (refusing an
    all-quarantined dataset); the indices it drops are counted in the list's ``skipped``. ``size``: the dataset's
    length (default: the wrapped sampler's ``data_source`` or ``dataset``, else its own length).

    ``len()``: exact for a sampler that draws every index once (``SequentialSampler``, ``RandomSampler`` without
    replacement over the whole dataset), for a ``DistributedSampler`` (counted over its own seeded order: no
    global RNG is drawn) and a fixed sequence of indices; for any other sampler, its own length — an upper bound, said once in the log."""

    def __init__(self, sampler: Iterable[int], quarantine: QuarantineList, key: Callable[[int], Key],
                 size: int | None = None) -> None:
        self.sampler, self.q = sampler, quarantine
        data = getattr(sampler, "data_source", None) or getattr(sampler, "dataset", None)
        n = size if size is not None else len(data) if data is not None else len(sampler)  # type: ignore[arg-type]
        self._size, self._warned = n, False
        hits: Counter[str] = Counter()
        self.blocked: set[int] = set()
        for i in range(n):
            hit = quarantine.match(*key(i))
            if hit is not None:
                self.blocked.add(i)
                hits[hit] += 1
        quarantine._account(hits, n, n - len(self.blocked))

    def __iter__(self) -> Iterator[int]:
        return (i for i in self.sampler if i not in self.blocked)

    def __len__(self) -> int:
        from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

        s = self.sampler
        if isinstance(s, SequentialSampler) or (isinstance(s, RandomSampler) and not s.replacement
                                                 and s.num_samples == self._size):
            return self._size - len(self.blocked)
        if isinstance(s, (DistributedSampler, range, list, tuple)):  # its own seeded order, or a fixed one: counted
            return sum(1 for i in s if i not in self.blocked)
        if not self._warned:
            self._warned = True
            log.info("gradloc: QuarantineSampler over a %s: len() is its length, an upper bound", type(s).__name__)
        return len(s)  # type: ignore[arg-type]


__all__ = ["EverySampleQuarantined", "Key", "QuarantineList", "QuarantineSampler"]
