"""Data provenance on a sample (SampleInfo.source / origin / tags): checked where it is built, carried exactly
over the wire and through the store's JSON, refused by the daemon past its limits, shown where a culprit is."""
from __future__ import annotations

import pytest

from gradloc.errors import BatchMetadataError
from gradloc.records import MAX_ORIGIN, MAX_SOURCE, MAX_TAGS, CulpritSpan, SampleInfo
from gradloc.reports import RankSpan
from gradloc.transport.codec_incidents import encode_incident
from gradloc.transport.decode_incidents import decode_incident
from gradloc.transport.validate import RejectedBatch
from tests.builders import incident_record, make_incident

INFO = SampleInfo(source="web-crawl", origin="shard-00017.jsonl:4211", tags={"lang": "en", "task": "qa"})


def test_tags_are_kept_sorted_and_provenance_reads_source_then_origin():
    assert INFO.tags == (("lang", "en"), ("task", "qa"))
    assert INFO.provenance == "web-crawl · shard-00017.jsonl:4211"
    assert SampleInfo(origin="a.txt:3").provenance == "a.txt:3" and SampleInfo().provenance == ""


@pytest.mark.parametrize("kw, says", [
    (dict(origin="x" * 10_000), f"origin must be a non-empty string of at most {MAX_ORIGIN} characters, got a string "
                                "of 10000 characters"),
    (dict(source="s" * (MAX_SOURCE + 1)), "source must be a non-empty string"),
    (dict(source=""), "source must be a non-empty string"),
    (dict(origin=42), "origin must be a non-empty string of at most 512 characters, got int"),
    (dict(tags={f"k{i}": "v" for i in range(MAX_TAGS + 1)}), f"tags must be at most {MAX_TAGS}"),
    (dict(tags=(("lang", "en"), ("lang", "fr"))), "tag keys must be distinct"),
    (dict(tags=(("lang",),)), "each tag must be a (key, value) pair"),
    (dict(tags={"lang": "x" * 65}), "each tag must be a (key, value) pair of non-empty strings of at most 64"),
])
def test_bad_provenance_is_a_clear_error_where_the_sample_info_is_built(kw, says):
    with pytest.raises(BatchMetadataError, match="SampleInfo: ") as err:
        SampleInfo(**kw)
    assert says in str(err.value)


def _with_info(info: SampleInfo):
    inc = incident_record(7)
    loc = inc.localization
    spans = tuple(CulpritSpan(**{**s.__dict__, "sample_info": info}) for s in loc.spans)
    from dataclasses import replace
    return replace(inc, localization=replace(loc, spans=spans))


def test_provenance_crosses_the_wire_exactly():
    inc = _with_info(INFO)
    back = decode_incident(encode_incident(inc), world_size=4, where="incident")
    assert back == inc and back.localization.spans[0].sample_info == INFO


def test_the_daemon_refuses_an_origin_past_the_limit_naming_the_field():
    msg = encode_incident(_with_info(SampleInfo(origin="ok")))
    msg.localization.spans[0].sample_info.origin = "x" * 10_000  # a client that skipped the check
    with pytest.raises(RejectedBatch) as err:
        decode_incident(msg, world_size=4, where="incident")
    assert err.value.reason == "invalid_value" and "origin must be" in err.value.message
    assert "localization.spans[0].sample_info" in err.value.message or "sample_info" in err.value.message


def test_provenance_survives_the_store_json_and_shows_in_the_text_and_the_page():
    from dataclasses import replace

    from gradloc.agent.incident_page import incident_html
    from gradloc.agent.render_correlated import correlated_text
    from gradloc.store.incident_json import correlated_from_dict, correlated_to_dict

    inc = make_incident()
    spans = tuple(RankSpan(rs.rank, rs.share, replace(rs.span, sample_info=INFO)) for rs in inc.spans)
    findings = tuple(replace(f, localization=replace(f.localization, spans=tuple(
        replace(s, sample_info=INFO) for s in f.localization.spans))) for f in inc.findings)
    inc = replace(inc, spans=spans, findings=findings)  # the correlator takes the spans from the rank findings
    assert correlated_from_dict(correlated_to_dict(inc)) == inc
    html = incident_html(inc)
    assert "web-crawl · shard-00017.jsonl:4211 [lang=en, task=qa]" in html
    assert "from: web-crawl · shard-00017.jsonl:4211 [lang=en, task=qa]" in correlated_text(inc, color=False)


def test_an_outlier_s_provenance_crosses_the_wire_in_its_step():
    from dataclasses import replace

    from gradloc.records import SampleOutlier, SampleStats
    from gradloc.transport.codec_findings import decode_samples, encode_samples
    from gradloc.transport.wire import pb

    out = SampleOutlier(kind="surprise", job="j", rank=0, step=3, time_unix=1.0, score=8.0, z=12.0, baseline=3.0,
                        micro_batch=1, sample=2, sample_id="u", start=0, end=8, tokens=8, text="t", detail="d",
                        sample_info=INFO)
    stats = SampleStats(judged=4, flagged=1, outliers=(out,))
    msg = pb.SampleStatsMsg()
    encode_samples(stats, msg)
    back = decode_samples(msg, "j", 0, 3, 1.0, "step")
    assert back.outliers == (out,)
    msg.outliers[0].sample_info.source = "s" * 65
    with pytest.raises(RejectedBatch, match="source must be"):
        decode_samples(msg, "j", 0, 3, 1.0, "step")
    assert replace(out, sample_info=None) != out
