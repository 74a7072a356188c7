"""Data provenance through Hugging Face ``datasets`` (gradloc/integrations/provenance.py): the row's source and
origin survive mixing, shuffling and collation, and the HF Trainer's incident names the planted row's origin.
Real ``datasets`` and ``transformers``, the tiny pre-trained Llama of tests/tiny_llama.py; nothing is mocked."""
from __future__ import annotations

import pytest
import torch

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

from transformers import default_data_collator  # noqa: E402

from gradloc.errors import BatchMetadataError  # noqa: E402
from gradloc.integrations.provenance import (  # noqa: E402
    ORIGIN,
    SAMPLE_INFOS,
    SOURCE,
    ProvenanceCollator,
    with_provenance,
)
from gradloc.integrations.transformers import GradlocTrainer  # noqa: E402
from gradloc.records import SampleInfo  # noqa: E402
from tests.helpers import single_thread  # noqa: E402,F401 (autouse fixture)
from tests.integrations.test_transformers import (  # noqa: E402
    GRADLOC,
    MB,
    ROW,
    args,
    causal_lm,
    check_planted,
    dataset,
    planted_index,
    world,  # noqa: F401 (the module fixture)
)


def _table(n: int, start: int = 0) -> "datasets.Dataset":
    return datasets.Dataset.from_dict({"text": [f"row {start + i}" for i in range(n)], "n": list(range(start, start + n))})


def test_rows_keep_their_source_and_origin_through_mixing_and_shuffling():
    web = with_provenance(_table(5), source="web", where="web-00.jsonl", tags={"lang": "en"})
    code = with_provenance(_table(3, 100), source="code", where="code.jsonl")
    mixed = datasets.concatenate_datasets([web, code]).shuffle(seed=3)
    seen = {(r["n"], r[SOURCE], r[ORIGIN], r.get("gradloc_tag_lang")) for r in mixed}
    assert seen == {*((i, "web", f"web-00.jsonl:{i}", "en") for i in range(5)),
                    *((100 + i, "code", f"code.jsonl:{i}", None) for i in range(3))}


def test_the_collator_hides_the_columns_and_hands_one_sample_info_per_row():
    seen_keys = []

    def inner(features):
        seen_keys.extend(sorted(f) for f in features)
        return default_data_collator(features)

    rows = list(with_provenance(_table(2), source="web", where="w.jsonl", tags={"task": "qa"}).remove_columns("text"))
    rows.append({"n": 7})  # a row without provenance
    batch = ProvenanceCollator(inner)(rows)
    assert seen_keys == [["n"]] * 3  # the wrapped collator never sees them
    assert list(batch[SAMPLE_INFOS]) == [SampleInfo(source="web", origin="w.jsonl:0", tags={"task": "qa"}),
                                         SampleInfo(source="web", origin="w.jsonl:1", tags={"task": "qa"}), SampleInfo()]
    assert batch["n"].tolist() == [0, 1, 7]


def test_bad_provenance_is_refused_before_training():
    with pytest.raises(BatchMetadataError, match="source must be"):
        with_provenance(_table(2), source="s" * 65)
    long_origin = _table(2).add_column("url", ["https://x/" + "a" * 10_000, "https://x/b"])
    with pytest.raises(BatchMetadataError, match="origin must be a non-empty string of at most 512"):
        with_provenance(long_origin, source="web", origin_column="url")
    # a column written by hand past the limits: collation (inside the training loop) keeps no provenance, counted
    collate = ProvenanceCollator(default_data_collator)
    batch = collate([{"n": 1, SOURCE: "web", ORIGIN: "o" * 600}, {"n": 2, SOURCE: "web", ORIGIN: "ok:2"}])
    assert collate.dropped == 1 and list(batch[SAMPLE_INFOS]) == [SampleInfo(), SampleInfo(source="web", origin="ok:2")]


def test_the_trainer_incident_names_the_planted_row_s_source_and_origin(world, tmp_path):  # noqa: F811
    rows = dataset(world)
    table = datasets.Dataset.from_list([{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in r.items()}
                                        for r in rows])
    ds = with_provenance(table, source="forum", where="forum-03.jsonl", tags={"lang": "en"})
    trainer = GradlocTrainer(model=causal_lm(world), args=args(tmp_path), train_dataset=ds,
                             data_collator=ProvenanceCollator(default_data_collator), processing_class=world.tok,
                             gradloc=GRADLOC, gradloc_sample_ids="uid")
    trainer.train()
    check_planted(trainer, str(rows[planted_index()]["uid"]))
    loc = trainer.gradloc.incidents[0].localization
    infos = {s.sample_info for s in loc.spans if (s.micro_batch, s.sample) == (MB, ROW)}
    assert infos == {SampleInfo(source="forum", origin=f"forum-03.jsonl:{planted_index()}", tags={"lang": "en"})}
