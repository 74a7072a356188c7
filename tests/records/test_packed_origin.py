"""The origin of a packed row (gradloc/records/packed_origin.py): its grammar, the resolver, the length limit.
The same against megatron-core's own GPTDataset rows: tests/integrations/test_megatron_provenance.py."""
from __future__ import annotations

from gradloc.records import MAX_ORIGIN, SampleInfo
from gradloc.records.packed_origin import DocumentAt, document_at, packed_origin, span_documents


def test_each_position_resolves_to_the_document_of_the_token_it_scores():
    origin = packed_origin("/data/web", [(16, 2, 0), (0, 0, 2), (15, 0, 12)])
    assert origin == "/data/web docs 16+2@0,0@2,15@12"
    info = SampleInfo(source="web", origin=origin)
    # position p scores token p + 1: tokens 0–1 are document 16's tokens 2–3, 2–11 document 0, 12… document 15
    assert document_at(info, 0) == DocumentAt("/data/web", 16, 3, 0)
    assert document_at(info, 1) == DocumentAt("/data/web", 0, 0, 1)
    assert document_at(info, 10) == DocumentAt("/data/web", 0, 9, 1)
    assert document_at(origin, 11) == DocumentAt("/data/web", 15, 0, 2)
    assert span_documents(info, 3, 7) == "document 0, its tokens 2–5"  # tokens 4–7 of the row
    assert span_documents(info, 5, 6) == "document 0, its token 4"
    assert span_documents(info, 9, 13) == "documents 0 → 15 (the span crosses a document boundary)"


def test_very_many_documents_keep_the_first_ones_the_last_and_a_counted_run():
    parts = [(10_000_000 + k, 7 if k == 0 else 0, 3 * k) for k in range(1000)]
    origin = packed_origin("/p" * 300, parts)  # a 600-character prefix too
    assert len(origin) <= MAX_ORIGIN
    where, body = origin.rsplit(" docs ", 1)
    assert where.startswith("…") and len(where) == 200
    kept = body.split(",")
    run = next(p for p in kept if p.startswith("…"))
    n_first = kept.index(run)
    assert kept[:n_first] == [f"{10_000_000}+7@0", *(f"{10_000_000 + k}@{3 * k}" for k in range(1, n_first))]
    assert run == f"…{1000 - 1 - n_first}@{3 * n_first}" and kept[-1] == f"{10_000_999}@2997"
    assert document_at(origin, 0).document == 10_000_000
    assert document_at(origin, 3 * n_first) is None  # inside the left-out run: no guess
    assert document_at(origin, 2997) == DocumentAt(where, 10_000_999, 1, 999)  # its true place in the row
    SampleInfo(origin=origin)  # within the record's limits


def test_anything_else_resolves_to_nothing():
    for origin in (None, "", "web-00.jsonl:4211", "x docs 1@0,oops", "x docs 1@5,2@5", "train:17"):
        assert document_at(origin, 3) is None and span_documents(origin, 0, 2) is None
    assert document_at(SampleInfo(), 0) is None
