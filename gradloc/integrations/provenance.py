"""Where each training sample came from, kept through shuffling and collation (Hugging Face ``datasets``).

    web = with_provenance(load_dataset("json", data_files="web-*.jsonl")["train"], source="web")
    code = with_provenance(load_dataset("json", data_files="code.jsonl")["train"], source="code",
                           tags={"task": "code"})
    mixture = concatenate_datasets([web, code]).shuffle(seed=0)   # or interleave_datasets
    trainer = GradlocTrainer(model=model, train_dataset=tokenized(mixture),
                             data_collator=ProvenanceCollator(DataCollatorForLanguageModeling(tok, mlm=False)))

:func:`with_provenance` adds two columns to every row — :data:`SOURCE` (the mixture component) and
:data:`ORIGIN` (``"<where>:<row>"``: the row's index in the dataset it was given, after ``where`` — name the data file there:
``datasets`` keeps no per-row file, so the default is the dataset's name; or a column the loader already has,
``origin_column``) — and a column
per tag. They are ordinary columns, so they survive ``shuffle``, ``select``, ``filter``, ``map`` (keep them in
``remove_columns``) and mixing. :class:`ProvenanceCollator` takes them out of the features before the collator it
wraps sees them, and puts one :class:`~gradloc.records.SampleInfo` per row in the batch under
:data:`SAMPLE_INFOS`; the HF Trainer integration pops that key (the model never sees it) and gives the infos to
the micro-batch, so a culprit or an outlier names "source · origin". A row without the columns gets no
provenance (it stays optional); bad values raise :class:`~gradloc.errors.BatchMetadataError` where
``with_provenance`` writes them (limits: ``records/provenance.py``), and are counted, never raised, once in the
training loop. The other integrations' helpers live here too: the Lightning/Accelerate form of a batch's
provenance (:func:`take_sample_infos`), verl's and OpenRLHF's rows (:func:`with_row_provenance`); Megatron's
in ``megatron_data.py``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import replace
from typing import Any

from gradloc.errors import BatchMetadataError
from gradloc.integrations.jagged import non_tensor
from gradloc.records import SampleInfo

log = logging.getLogger("gradloc")

SOURCE, ORIGIN = "gradloc_source", "gradloc_origin"
TAG_PREFIX = "gradloc_tag_"
SAMPLE_INFOS = "gradloc_sample_infos"  # the batch key ProvenanceCollator adds (a SampleInfos) and integrations pop


def with_provenance(dataset: Any, source: str | None = None, *, where: str | None = None,
                    origin_column: str | None = None, tags: Mapping[str, str] | None = None) -> Any:
    """``dataset`` (a ``datasets.Dataset``) with the provenance columns (module docstring). ``where``: what the
    origin names before the row — the data file (default: the dataset's name); ``origin_column``: a
    column that already says where each row lives (a URL, a path), used instead of ``where:row``."""
    if origin_column is not None and origin_column not in dataset.column_names:
        raise KeyError(f"origin_column {origin_column!r} is not a column of the dataset ({dataset.column_names})")
    probe = SampleInfo(source=source, origin=f"{where or 'x'}:0", tags=dict(tags or {}))  # the checks, once
    label = where or _where(dataset)
    extra = {f"{TAG_PREFIX}{k}": v for k, v in probe.tags}

    def add(row: Mapping[str, Any], index: int) -> dict[str, Any]:
        origin = str(row[origin_column]) if origin_column is not None else f"{label}:{index}"
        SampleInfo(origin=origin)  # a bad origin (10 kB, empty) is a clear error here, before training
        return {SOURCE: source, ORIGIN: origin, **extra}

    return dataset.map(add, with_indices=True, desc="gradloc provenance")


def _where(dataset: Any) -> str:
    """The dataset's name (``datasets`` keeps no per-row file: name it with ``where=``, or give a column)."""
    info = getattr(dataset, "info", None)
    return getattr(info, "dataset_name", None) or getattr(info, "builder_name", None) or "row"


def provenance_columns(columns: Sequence[str]) -> list[str]:
    """The provenance columns among ``columns`` (what a Trainer must not drop as unused)."""
    return [c for c in columns if c in (SOURCE, ORIGIN) or c.startswith(TAG_PREFIX)]


def sample_info(row: Mapping[str, Any]) -> SampleInfo | None:
    """A row's provenance as a SampleInfo; None when the row has none."""
    tags = {k[len(TAG_PREFIX):]: str(v) for k, v in row.items() if k.startswith(TAG_PREFIX) and v is not None}
    source, origin = row.get(SOURCE), row.get(ORIGIN)
    if source is None and origin is None and not tags:
        return None
    return SampleInfo(source=None if source is None else str(source), origin=None if origin is None else str(origin),
                      tags=tags)


class SampleInfos:
    """One SampleInfo per row of a batch, as :class:`ProvenanceCollator` puts it under :data:`SAMPLE_INFOS`. An
    opaque holder, not a list, on purpose: frameworks that walk a batch to move it to the device rebuild what
    they recognise — Lightning's ``apply_to_collection`` rebuilds every dataclass in a list and refuses frozen
    ones (SampleInfo is frozen) — and pass an object they do not know through unchanged. Iterable and sized."""

    __slots__ = ("infos",)

    def __init__(self, infos: Sequence[SampleInfo]) -> None:
        self.infos = tuple(infos)

    def __iter__(self) -> Iterator[SampleInfo]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SampleInfos) and other.infos == self.infos

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SampleInfos({list(self.infos)!r})"


class ProvenanceCollator:
    """Wraps a collator: each feature's provenance columns are taken out before ``collate`` sees them and come back
    as one SampleInfo per row under :data:`SAMPLE_INFOS` (an empty SampleInfo for a row without provenance; the
    key is left out when no row has any). Collation runs in the training loop: a row whose columns were written
    by hand and break the limits keeps no provenance, counted in ``dropped`` and logged, never raised."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate
        self.dropped = 0  # rows whose provenance columns were invalid

    def _drop(self, n: int) -> None:
        self.dropped += n

    def __call__(self, features: list[Any]) -> Any:
        rows, rest = [], []
        for f in features:
            if isinstance(f, Mapping):
                cols = provenance_columns(list(f))
                rows.append({c: f[c] for c in cols})
                rest.append({k: v for k, v in f.items() if k not in cols})
            else:
                rows.append({})
                rest.append(f)
        infos = rows_sample_infos(rows, self._drop)
        batch = self.collate(rest)  # the wrapped collator never sees the provenance columns
        if infos is not None and isinstance(batch, dict):
            batch[SAMPLE_INFOS] = SampleInfos(infos)
        return batch


def rows_sample_infos(rows: Sequence[Mapping[str, Any]], on_drop: Callable[[int], None] | None = None
                      ) -> list[SampleInfo] | None:
    """One SampleInfo per row from its provenance columns (:func:`sample_info`; an empty one for a row without),
    None when no row has any. This runs in the training loop: a row whose values break the limits keeps none —
    ``on_drop(n)`` counts them, a warning says so — never an exception."""
    out: list[SampleInfo | None] = []
    bad = 0
    for row in rows:
        try:
            out.append(sample_info(row))
        except BatchMetadataError:
            out.append(None)
            bad += 1
    _dropped(bad, on_drop, "row(s) of a batch have invalid provenance columns")
    return [i if i is not None else SampleInfo() for i in out] if any(i is not None for i in out) else None


def verl_provenance(infos: tuple[SampleInfo, ...], data_source: Any, extra_info: Any) -> tuple[SampleInfo, ...]:
    """Each sequence's SampleInfo with verl's provenance: ``data_source`` (the dataset a prompt came from) as the
    source, and ``extra_info``'s ``split``/``index`` (what verl's preprocessing scripts write per row) as the
    origin "<split>:<index>" (or "row <index>"). Missing or ragged columns leave the infos as they are. verl's
    ``uid`` is not provenance: a fresh uuid4 per prompt and rollout batch (``ray_trainer.py``), already each
    sequence's ``request_id`` and sample id."""
    sources, extras = non_tensor(data_source), non_tensor(extra_info)
    B = len(infos)
    sources = list(sources) if isinstance(sources, (list, tuple)) and len(sources) == B else [None] * B
    extras = list(extras) if isinstance(extras, (list, tuple)) and len(extras) == B else [None] * B
    rows = []
    for src, extra in zip(sources, extras):
        origin = None
        if isinstance(extra, Mapping) and extra.get("index") is not None:
            split = extra.get("split")
            origin = f"{split}:{extra['index']}" if split else f"row {extra['index']}"
        rows.append((str(src) if src else None, origin))
    return with_row_provenance(infos, rows)


def with_row_provenance(infos: Sequence[SampleInfo], rows: Sequence[tuple[str | None, str | None]] | None,
                        on_drop: Callable[[int], None] | None = None) -> tuple[SampleInfo, ...]:
    """Each info with its row's (source, origin), its RL request and spans kept; ``rows`` missing or ragged leave
    the infos as they are. On the training path: a row whose values break the limits keeps its info as it was
    (``on_drop(n)`` counts them, a warning says so), never an exception."""
    if rows is None or len(rows) != len(infos):
        return tuple(infos)
    out, bad = [], 0
    for info, (source, origin) in zip(infos, rows):
        try:
            out.append(replace(info, source=source, origin=origin) if source or origin else info)
        except BatchMetadataError:
            out.append(info)
            bad += 1
    _dropped(bad, on_drop, "sequence(s) of a batch have an invalid source or origin")
    return tuple(out)


def _dropped(n: int, on_drop: Callable[[int], None] | None, what: str) -> None:
    """``n`` rows kept no provenance: counted (``on_drop``) and said — the training path's regime."""
    if n:
        if on_drop is not None:
            on_drop(n)
        log.warning("gradloc: %d %s; they keep none", n, what)


def pop_sample_infos(inputs: Mapping[str, Any], on_drop: Callable[[int], None] | None = None
                     ) -> tuple[Mapping[str, Any], list[SampleInfo] | None]:
    """The batch without its provenance (the model never sees it), and one SampleInfo per row (None: the batch
    has none) — see :func:`take_sample_infos`; ``inputs`` is left as it was."""
    if SAMPLE_INFOS not in inputs and not provenance_columns(list(inputs)):
        return inputs, None
    rest = dict(inputs)
    return rest, take_sample_infos(rest, on_drop)


def take_sample_infos(batch: Any, on_drop: Callable[[int], None] | None = None) -> list[SampleInfo] | None:
    """Remove the batch's provenance *in place* and return one SampleInfo per row (None when it has none, or the
    batch is not a mutable mapping). Both forms: :data:`SAMPLE_INFOS` (:class:`ProvenanceCollator`), or the
    provenance columns collated into lists of strings (torch's ``default_collate`` of samples that carry them, as
    ``megatron_data.MegatronProvenance``'s do). In place because a loop (Lightning, Accelerate) hands the same
    batch object to the user's model afterwards: a leftover key would reach ``model(**batch)``. Never raises:
    invalid rows keep no provenance (``on_drop`` counts them); ragged columns give none at all (counted so)."""
    if not isinstance(batch, MutableMapping):
        return None
    if SAMPLE_INFOS in batch:
        return list(batch.pop(SAMPLE_INFOS))
    cols = {c: batch.pop(c) for c in provenance_columns(list(batch))}
    if not cols:
        return None
    lists = [v for v in cols.values() if isinstance(v, (list, tuple))]
    n = len(lists[0]) if lists else 0
    if len(lists) != len(cols) or any(len(v) != n for v in lists):
        if on_drop is not None:
            on_drop(max(n, 1))
        log.warning("gradloc: the batch's provenance columns are not one list per column of equal lengths (%s); "
                    "the batch keeps no provenance", {c: type(v).__name__ for c, v in cols.items()})
        return None
    return rows_sample_infos([{c: v[i] for c, v in cols.items() if v[i] is not None} for i in range(n)], on_drop)


__all__ = ["ORIGIN", "SAMPLE_INFOS", "SOURCE", "TAG_PREFIX", "ProvenanceCollator", "SampleInfos", "pop_sample_infos",
           "provenance_columns", "rows_sample_infos", "sample_info", "take_sample_infos", "verl_provenance",
           "with_provenance", "with_row_provenance"]
