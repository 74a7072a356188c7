"""Provenance of Megatron-core's GPT samples: which blend component and which documents each packed row holds.

    train_ds, valid_ds, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, is_built, config).build()
    train_ds = MegatronProvenance(train_ds)              # a BlendedDataset or a single GPTDataset
    ...                                                  # Megatron's sampler and loader, default collation
    batch = next(data_iterator)
    batch, infos = pop_sample_infos(batch)               # gradloc.integrations.provenance
    with mon.micro_batch(token_ids=batch["labels"], loss_mask=batch["loss_mask"].bool(), sample_infos=infos):
        ...

What Megatron knows (megatron-core 0.19, DESIGN.md §9): ``BlendedDataset`` draws each sample from one of its
``datasets`` (``dataset_index[idx]``, at ``dataset_sample_index[idx]`` of it); a ``GPTDataset`` row is *packed*
from several documents of its indexed dataset — ``_query_document_sample_shuffle_indices(idx)`` gives their ids
and token counts, and ``sample_index`` where the first one starts — but ``__getitem__`` drops the ids. So
:class:`MegatronProvenance` asks again (one more read of the row's tokens from the memory-mapped ``.bin``, in
the loader's workers) and adds two string fields to every sample:

- :data:`~gradloc.integrations.provenance.SOURCE`: the blend component — by default the last part of its path
  prefix (``/data/web_text_document`` → ``web_text_document``), or the name given in ``sources``;
- :data:`~gradloc.integrations.provenance.ORIGIN`: the path prefix and the row's documents with the token where
  each begins (``/data/web_text_document docs 16+2@0,0@2,15@12``: the grammar of
  gradloc/records/packed_origin.py; :func:`document_at` resolves a gradloc position to its one document, and
  incidents print the document a culprit span lies in).

Plain strings because torch's ``default_collate`` (Megatron's) collates strings into lists and cannot collate a
SampleInfo; :func:`~gradloc.integrations.provenance.pop_sample_infos` turns the two lists into SampleInfos where
the batch enters gradloc (the Lightning, Accelerate and HF Trainer integrations do it themselves). Megatron's
``get_batch`` reads only its own keys, so the extra two never reach the model. A packed row is one gradloc
sample with one origin: its documents are told apart by position, not as separate samples.

Never raises while training: a row whose document ids cannot be read keeps the origin ``"<prefix> sample <i>"``
(its index in the component), counted in ``dropped`` (per loader worker) and logged. Duck-typed: megatron is
never imported here.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch

from gradloc.errors import BatchMetadataError
from gradloc.integrations.provenance import ORIGIN, SOURCE, pop_sample_infos
from gradloc.records import MAX_ORIGIN, MAX_SOURCE, SampleInfo
from gradloc.records.packed_origin import DocumentAt, document_at, packed_origin

log = logging.getLogger("gradloc")


class MegatronProvenance(torch.utils.data.Dataset):
    """``dataset`` (a Megatron ``BlendedDataset`` or ``GPTDataset``) whose samples also carry
    :data:`SOURCE` and :data:`ORIGIN` (module docstring). ``sources``: one name per blend component, in the
    blend's order (default: each component's file name); bad names raise here, before training."""

    def __init__(self, dataset: Any, sources: Sequence[str] | None = None) -> None:
        self.blended = hasattr(dataset, "dataset_index") and hasattr(dataset, "datasets")
        components = list(dataset.datasets) if self.blended else [dataset]
        for c in components:
            if not callable(getattr(c, "_query_document_sample_shuffle_indices", None)):
                raise BatchMetadataError(f"MegatronProvenance: {type(c).__name__} is not a Megatron GPTDataset "
                                         "(no _query_document_sample_shuffle_indices)")
        if sources is not None and len(sources) != len(components):
            raise BatchMetadataError(f"MegatronProvenance: {len(sources)} source names for {len(components)} "
                                     "blend components")
        names = list(sources) if sources is not None else [_name(c) for c in components]
        for name in names:
            SampleInfo(source=name)  # the checks, once: a bad name is a clear error here
        self.dataset, self.components, self.sources = dataset, components, names
        self.dropped = 0  # rows whose document ids could not be read (this process's)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        sample = self.dataset[idx]  # first: a BlendedDataset maps its indices lazily here
        if self.blended:
            which, inner = int(self.dataset.dataset_index[idx]), int(self.dataset.dataset_sample_index[idx])
        else:
            which, inner = 0, idx
        return {**sample, SOURCE: self.sources[which], ORIGIN: self.origin(which, inner)}

    def origin(self, component: int, idx: int | None) -> str:
        """The origin of row ``idx`` of blend component ``component`` (never raises: see the module docstring)."""
        ds = self.components[component]
        where = str(getattr(ds, "dataset_path", None) or self.sources[component])
        if idx is None:  # GPTDataset's batch-padding row (no loss)
            return f"{where} padding"
        try:
            _, documents, lengths = ds._query_document_sample_shuffle_indices(idx)
            skip = int(ds.sample_index[ds.shuffle_index[idx]][1])  # the first document's tokens before the row
            starts = [0, *accumulate(int(n) for n in lengths)][:-1]
            return packed_origin(where, [(int(d), skip if k == 0 else 0, a)  # an empty part holds no token
                                         for k, (d, a, n) in enumerate(zip(documents, starts, lengths)) if n > 0])
        except Exception:
            self.dropped += 1
            log.warning("gradloc: the documents of row %s of %s could not be read (%d so far); its origin is the "
                        "row's index", idx, where, self.dropped, exc_info=self.dropped == 1)
            return f"{where} sample {idx}"[-MAX_ORIGIN:]


def _name(component: Any) -> str:
    """A component's default source name: its path prefix's file name (at most MAX_SOURCE characters)."""
    path = getattr(component, "dataset_path", None)
    name = os.path.basename(str(path).rstrip("/")) if path else type(component).__name__
    return name[-MAX_SOURCE:] or "megatron"


__all__ = ["DocumentAt", "MegatronProvenance", "document_at", "pop_sample_infos"]
