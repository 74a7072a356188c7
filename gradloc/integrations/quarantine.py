"""Keep quarantined data out of a resumed run: the loader side of ``gradloc-agent quarantine``.

    q = QuarantineList.load("quarantine.jsonl")          # gradloc-agent quarantine export quarantine.jsonl
    train = q.filter_dataset(with_provenance(ds, source="web"), id_column="uid")   # HF datasets
    loader = DataLoader(ds, sampler=QuarantineSampler(RandomSampler(ds), q, key=lambda i: ds.provenance(i)))

A row is skipped when its sample id, its origin or its source is on the list (the columns ``with_provenance``
adds, ``integrations/provenance.py``). Both helpers count what they skipped (``skipped``, by kind) and refuse —
with a clear error — a list that would leave no sample: a loader that trains on nothing is never the answer.
``with_lookalikes`` adds the rows that look like quarantined ones (a content fault gradloc flagged only the first few
rows of: integrations/lookalike.py).
Lines of the list that are not entries (malformed JSON, an unknown kind, a value past its limit) are skipped,
counted in ``QuarantineList.bad_lines`` and logged, never guessed.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradloc.integrations import lookalike
from gradloc.integrations.lookalike import LookalikeConfig
from gradloc.integrations.provenance import ORIGIN, SOURCE
from gradloc.records import QuarantineEntry, QuarantineKind, to_dict
from gradloc.records.quarantine import MAX_REASON, entries_jsonl, parse_jsonl

log = logging.getLogger("gradloc")
Key = lookalike.Key  # (sample id, origin, source) of one sample


class EverySampleQuarantined(ValueError):
    """The quarantine would remove every sample of the data it filters."""


@dataclass
class QuarantineList:
    entries: tuple[QuarantineEntry, ...] = ()
    bad_lines: int = 0  # lines of the loaded list that were not valid entries (logged)
    skipped: Counter[str] = field(default_factory=Counter)  # samples a helper left out, by the kind that matched
    unnamed_lookalikes: int = 0  # look-alike rows with_lookalikes could not name (no origin, no sample id)

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
        entries, bad = parse_jsonl(lines)
        for n, why in bad:
            log.warning("gradloc: quarantine line %d is not an entry (%s); skipped", n, why)
        return cls(tuple(entries), bad_lines=len(bad))

    def match(self, sample_id: str | None = None, origin: str | None = None, source: str | None = None) -> str | None:
        """The kind of entry that keeps this sample out (None: it stays)."""
        if sample_id is not None and str(sample_id) in self._samples:
            return QuarantineKind.SAMPLE.value
        if origin is not None and origin in self._origins:
            return QuarantineKind.ORIGIN.value
        if source is not None and source in self._sources:
            return QuarantineKind.SOURCE.value
        return None

    def entry_of(self, key: Key) -> QuarantineEntry | None:
        """The sample id or origin entry that holds a row (None: none does; a source entry is not a row's)."""
        sample_id, origin, _ = key
        for e in self.entries:
            if (e.kind == QuarantineKind.SAMPLE and sample_id is not None and e.value == str(sample_id)) or \
                    (e.kind == QuarantineKind.ORIGIN and origin is not None and e.value == origin):
                return e
        return None

    def with_lookalikes(self, rows: Sequence[Sequence[int]], keys: Sequence[Key],
                        cfg: LookalikeConfig | None = None) -> QuarantineList:
        """This list and an origin (else sample id) entry for every row that looks like a quarantined row
        (integrations/lookalike.py: ``rows[i]`` row i's token ids, ``keys[i]`` its (sample id, origin, source);
        ``dataset_keys`` gives them for an HF dataset). A look-alike without an origin or id cannot be named: counted
        in ``unnamed_lookalikes`` and logged."""
        held = {i for i, k in enumerate(keys) if self.match(k[0], k[1]) is not None}
        found = lookalike.find(rows, keys, lambda k: self.match(k[0], k[1]) is not None, cfg or LookalikeConfig())
        added, unnamed = [], 0
        for la in found:
            kind, value = (QuarantineKind.ORIGIN, la.key[1]) if la.key[1] else (QuarantineKind.SAMPLE, la.key[0])
            if not value:
                unnamed += 1
                continue
            seed = self.entry_of(keys[la.like])
            added.append(QuarantineEntry(kind=kind, value=str(value), added_unix=time.time(),
                                         reason=f"looks like {seed.value if seed else la.like}: token mix "
                                                f"{la.similarity:.2f} alike, {la.atypical_z:.1f} MAD from its "
                                                f"source's"[:MAX_REASON],
                                         job=seed.job if seed else None, step=seed.step if seed else None,
                                         incident_id=seed.incident_id if seed else None))
        if unnamed:
            log.warning("gradloc: %d look-alike rows have neither an origin nor a sample id: not quarantined", unnamed)
        log.info("gradloc: %d rows look like the %d quarantined ones", len(added), len(held))
        out = QuarantineList(self.entries + tuple(added), bad_lines=self.bad_lines)
        out.unnamed_lookalikes = unnamed
        return out

    def save(self, path: str | Path) -> None:
        """Write the list as ``gradloc-agent quarantine export`` does (one JSON entry per line): for ``load``, or
        ``gradloc-agent quarantine import`` into a store."""
        Path(path).write_text(entries_jsonl(self.entries), encoding="utf-8")

    def filter_dataset(self, dataset: Any, id_column: str | None = None) -> Any:
        """A ``datasets.Dataset`` without its quarantined rows (by ``id_column`` and the provenance columns)."""
        kept, hits = [], Counter()
        for i, key in enumerate(dataset_keys(dataset, id_column)):
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


def dataset_keys(dataset: Any, id_column: str | None = None) -> list[Key]:
    """Each row's (sample id, origin, source) of a ``datasets.Dataset`` (``id_column`` and the provenance columns
    ``with_provenance`` adds; None where a column is absent)."""
    cols = set(dataset.column_names)
    columns = [dataset[c] if c is not None and c in cols else [None] * len(dataset) for c in (id_column, ORIGIN, SOURCE)]
    return list(zip(*columns))


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


__all__ = ["EverySampleQuarantined", "Key", "QuarantineList", "QuarantineSampler", "dataset_keys"]
