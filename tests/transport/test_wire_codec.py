"""The codec without a network: exact round trips, the NaN policy, all-or-nothing validation."""
from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from gradloc.records import LayerShare, Remedy, SampleShare, TokenScore, TokenStats, to_dict
from gradloc.transport.codec import BatchDecoder, LayerTableCache, batch_bytes, encode_step
from gradloc.transport.validate import RejectedBatch
from gradloc.transport.wire import layer_table_id, pb

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.*` under plain `pytest` too
from tests.builders import JOB, incident_record, layer, step_record  # noqa: E402
from tests.transport.factories import (  # noqa: E402
    INF,
    NAN,
    assert_summary_equal,
    client_info,
    encode,
    incidents,
    step_records,
    to_bytes,
)


def decode(data: bytes, decoder: BatchDecoder | None = None):
    return (decoder or BatchDecoder()).decode(data)


def rejected(data: bytes, decoder: BatchDecoder | None = None) -> RejectedBatch:
    with pytest.raises(RejectedBatch) as info:
        decode(data, decoder)
    return info.value


# -- round trips -------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(step_records())
def test_step_round_trip_equals_summarize(rec):
    (got,) = decode(to_bytes([rec])).steps
    assert_summary_equal(got, rec)


@settings(max_examples=150, deadline=None)
@given(incidents())
def test_incident_round_trip(inc):
    (got,) = decode(to_bytes([], [inc])).incidents
    assert to_dict(got) == to_dict(inc)  # to_dict spells NaN "nan": equal where the dataclasses' NaN is not
    if "nan" not in str(to_dict(inc)):
        assert got == inc


def test_none_and_zero_stay_distinct_and_empty_collections_survive():
    inc = incident_record()
    spike = replace(inc.spike, z=0.0, mean=None, std=0.0, loss=None, loss_z=None, loss_mean=0.0, layers=())
    loc = replace(inc.localization, explained_share=0.0, culprit_norm=None, culprits=(), spans=(),
                  micro_batch_shares=(), loss_share=None, loss_without_culprits=0.0)
    zeros = replace(inc, spike=spike, localization=loc, top_layers=(layer("a", 0.0, update_ratio=None),))
    unlocalized = replace(inc, localization=None, top_layers=())
    assert decode(to_bytes([], [zeros, unlocalized])).incidents == (zeros, unlocalized)
    rec = step_record(loss=None, grad_scale=0.0, tokens=TokenStats(tokens=0, total_score=0.0, top=(), top_share=0.0,
                                                            micro_batch_shares=(), unattributed_share=0.0))
    (got,) = decode(to_bytes([rec])).steps
    assert got.loss is None and got.grad_scale == 0.0 and got.tokens == rec.tokens
    assert_summary_equal(got, rec)


def test_a_step_with_no_layers_and_a_record_from_another_job_and_rank():
    recs = [step_record(0, layers=()), step_record(1, job="other", rank=3), step_record(2)]
    got = decode(to_bytes(recs)).steps
    assert [(s.job, s.rank) for s in got] == [(JOB, 1), ("other", 3), (JOB, 1)]
    for g, r in zip(got, recs):
        assert_summary_equal(g, r)


def test_token_layer_shares_outside_the_table_and_missing_ids():
    top = (TokenScore(micro_batch=0, sample=1, position=2, score=5.0, share=0.5, token_id=None, sample_id=None,
                      layers=(LayerShare("head", 0.6), LayerShare("not-a-layer", 0.4))),
           TokenScore(micro_batch=1, sample=0, position=3, score=4.0, share=0.4, token_id=17, sample_id="uid-9",
                      layers=()),
           TokenScore(micro_batch=1, sample=2, position=0, score=1.0, share=0.1, token_id=0, sample_id="",
                      layers=(LayerShare("not-a-layer", 1.0),)))
    rec = step_record(tokens=TokenStats(tokens=96, total_score=10.0, top=top, top_share=0.5, micro_batch_shares=(0.6, 0.4),
                                 unattributed_share=0.02, dropped_calls=3))
    msg, (m,) = encode([rec])
    assert list(m.tokens.extra_layers) == ["not-a-layer"] and list(m.tokens.sample_id_none) == [0]
    assert decode(msg.SerializeToString()).steps[0].tokens == rec.tokens


def test_unknown_update_ratios_are_nan_and_all_unknown_sends_no_column():
    rec = step_record(layers=(layer("a", update_ratio=None), layer("b", update_ratio=0.5)))
    (got,) = decode(to_bytes([rec])).steps
    assert math.isnan(got.layers.update_ratio[0]) and got.layers.update_ratio[1] == 0.5
    first = step_record(layers=(layer("a", update_ratio=None), layer("b", update_ratio=None)))
    _, (m,) = encode([first])
    assert len(m.update_ratio) == 0
    assert np.isnan(decode(to_bytes([first])).steps[0].layers.update_ratio).all()


def test_layer_table_id_is_stable_and_injective():
    assert layer_table_id(("a", "b")) == layer_table_id(("a", "b"))
    assert len({layer_table_id(t) for t in [("a", "b"), ("ab",), ("a\x00b",), ("b", "a"), ()]}) == 5
    # pinned to its definition (clients and daemons of any version must agree): blake2b-64, little-endian,
    # of the LayerTable encoding — field 2, length-prefixed, per name
    digest = hashlib.blake2b(b"\x12\x05embed\x12\x04head", digest_size=8).digest()
    assert layer_table_id(("embed", "head")) == int.from_bytes(digest, "little") == 0x57AAF7DAE6522976


def test_batch_bytes_concatenation_is_the_same_message():
    msg, steps = encode([step_record(0), step_record(1)], [incident_record()])
    header = pb.IngestBatch()
    header.CopyFrom(msg)
    del header.steps[:], header.incidents[:]
    data = batch_bytes(header, [s.SerializeToString() for s in steps], [i.SerializeToString() for i in msg.incidents])
    assert pb.IngestBatch.FromString(data) == msg


# -- the NaN policy -----------------------------------------------------------------------------------
def test_nonfinite_gradients_are_data_when_counted():
    bad = layer("blocks.0", NAN, grad_max_abs=INF, param_norm=NAN, nonfinite=12, update_ratio=INF)
    score = TokenScore(micro_batch=0, sample=0, position=1, score=INF, share=NAN, token_id=None, sample_id=None,
                       layers=(LayerShare("head", NAN),))
    tokens = TokenStats(tokens=8, total_score=NAN, top=(score,), top_share=NAN, micro_batch_shares=(NAN,),
                        unattributed_share=INF)
    rec = step_record(layers=(layer("embed"), bad, layer("head")), global_norm=INF, nonfinite=12, loss=NAN, tokens=tokens)
    (got,) = decode(to_bytes([rec])).steps
    assert_summary_equal(got, rec)
    inc = incident_record(spike=replace(incident_record().spike, kinds=("nonfinite_grad",), global_norm=INF, z=None),
                   localization=replace(incident_record().localization, global_norm=INF, explained_share=INF))
    assert to_dict(decode(to_bytes([], [inc])).incidents[0]) == to_dict(inc)


def test_nonfinite_loss_is_accepted_everywhere():
    inc = incident_record(spike=replace(incident_record().spike, loss=-INF),
                   localization=replace(incident_record().localization, loss_share=NAN, loss_without_culprits=INF))
    rec = step_record(loss=INF)
    got = decode(to_bytes([rec], [inc]))
    assert got.steps[0].loss == INF and to_dict(got.incidents[0]) == to_dict(inc)


def test_overflowed_norms_of_finite_elements_are_accepted():
    """A float32 sum of squares overflows above ~1.8e19 while every element is finite: +inf norms
    without a nonfinite count are the largest spikes there are, not bad input."""
    rec = step_record(global_norm=INF, layers=(layer("a", INF, grad_max_abs=3e38), layer("b")))
    inc = incident_record(spike=replace(incident_record().spike, global_norm=INF),
                   localization=replace(incident_record().localization, global_norm=INF, norm_without_culprits=INF))
    got = decode(to_bytes([rec], [inc]))
    assert got.steps[0].global_norm == INF and got.steps[0].layers.grad_norm[0] == INF
    assert to_dict(got.incidents[0]) == to_dict(inc)


BAD_FLOATS = [  # (what, record factory, field named in the message)
    ("global norm without a nonfinite count", lambda: step_record(global_norm=NAN), "steps[0].global_norm"),
    ("layer norm without the layer's count", lambda: step_record(layers=(layer("a"), layer("b", NAN)), nonfinite=3),
     "steps[0].grad_norm[1] (layer 'b')"),
    ("infinite update ratio", lambda: step_record(layers=(layer("a", update_ratio=-INF),)), "steps[0].update_ratio[0]"),
    ("time", lambda: step_record(time_unix=INF), "steps[0].time_unix"),
    ("grad scale", lambda: step_record(grad_scale=NAN), "steps[0].grad_scale"),
    ("overhead", lambda: step_record(overhead=INF), "steps[0].overhead"),
    ("step seconds", lambda: step_record(step_s=NAN), "steps[0].step_seconds"),
    ("token share", lambda: step_record(tokens=TokenStats(tokens=8, total_score=1.0, top=(), top_share=0.5,
                                                   micro_batch_shares=(0.5, NAN), unattributed_share=0.0)),
     "steps[0].tokens.micro_batch_shares[1]"),
    ("token layer share", lambda: step_record(tokens=TokenStats(tokens=8, total_score=1.0, top=(TokenScore(
        micro_batch=0, sample=0, position=0, score=1.0, share=1.0, token_id=None, sample_id=None,
        layers=(LayerShare("head", 1.0), LayerShare("embed", INF))),), top_share=1.0, micro_batch_shares=(),
        unattributed_share=0.0)), "steps[0].tokens.layer_share[1]"),
]
BAD_INCIDENT_FLOATS = [
    ("spike z", lambda: incident_record(spike=replace(incident_record().spike, z=NAN)), "incidents[0].spike.z"),
    ("spike std", lambda: incident_record(spike=replace(incident_record().spike, std=INF)), "incidents[0].spike.std"),
    ("spike norm", lambda: incident_record(spike=replace(incident_record().spike, global_norm=NAN)),
     "incidents[0].spike.global_norm"),
    ("infinite culprit share", lambda: incident_record(localization=replace(incident_record().localization, culprits=(
        replace(incident_record().localization.culprits[0], share=INF),))), "incidents[0].localization.culprits[0].share"),
    ("loss share with a finite loss", lambda: incident_record(localization=replace(incident_record().localization,
                                                                            loss_share=NAN)),
     "incidents[0].localization.loss_share"),
    ("incident time", lambda: incident_record(time_unix=NAN), "incidents[0].time_unix"),
]


@pytest.mark.parametrize("what,make,field", BAD_FLOATS, ids=[c[0] for c in BAD_FLOATS])
def test_forbidden_nonfinite_step_values_are_rejected(what, make, field):
    err = rejected(to_bytes([step_record(0), make()]))
    assert err.reason == "nonfinite" and field.replace("steps[0]", "steps[1]") in err.message


@pytest.mark.parametrize("what,make,field", BAD_INCIDENT_FLOATS, ids=[c[0] for c in BAD_INCIDENT_FLOATS])
def test_forbidden_nonfinite_incident_values_are_rejected(what, make, field):
    err = rejected(to_bytes([], [make()]))
    assert err.reason == "nonfinite" and field in err.message


def test_nan_culprit_shares_mean_not_measurable_and_are_accepted():
    loc = replace(incident_record().localization, explained_share=NAN,
                  culprits=(replace(incident_record().localization.culprits[0], share=NAN, score_share=NAN),))
    inc = incident_record(localization=loc)
    assert to_dict(decode(to_bytes([], [inc])).incidents[0]) == to_dict(inc)


# -- structural validation ---------------------------------------------------------------------------
def _band(m, mean: float, threshold: float) -> None:
    m.norm_mean, m.norm_threshold = mean, threshold


def _edit(edit, recs=None, incs=(), **kw) -> bytes:
    msg, _ = encode(recs if recs is not None else [step_record(0)], list(incs), **kw)
    edit(msg)
    return msg.SerializeToString()


STRUCTURE = [  # (what, batch bytes, reason, words in the message)
    ("not protobuf", lambda: b"\xff\xff\xff not a protobuf", "malformed", "IngestBatch"),
    ("schema version", lambda: to_bytes([step_record()], schema_version=2), "schema_version", "[1]"),
    ("no schema version", lambda: to_bytes([step_record()], schema_version=0), "schema_version", "schema_version 0"),
    ("rank >= world size", lambda: to_bytes([step_record()], client=client_info(rank=4)), "invalid_value",
     "client.rank is 4, outside [0, world_size=4)"),
    ("step rank >= world size", lambda: to_bytes([step_record(rank=9)]), "invalid_value", "steps[0].rank is 9"),
    ("empty job", lambda: to_bytes([step_record()], client=client_info(job="")), "invalid_value", "client.job is empty"),
    ("negative rank", lambda: to_bytes([step_record()], client=client_info(rank=-1)), "invalid_value", "client.rank is -1"),
    ("negative step", lambda: to_bytes([step_record(-5)]), "invalid_value", "steps[0].step is -5"),
    ("negative numel", lambda: to_bytes([step_record(layers=(layer("a"), layer("b", numel=-1)))]), "invalid_value",
     "steps[0].numel[1] (layer 'b')"),
    ("negative probes", lambda: to_bytes([], [incident_record(localization=replace(incident_record().localization, probes=-2))]),
     "invalid_value", "incidents[0].localization.probes is -2"),
    ("long job", lambda: to_bytes([step_record()], client=client_info(job="j" * 5000)), "invalid_value",
     "client.job has 5000"),
    ("column length", lambda: _edit(lambda m: m.steps[0].grad_norm.append(1.0)), "length_mismatch",
     "steps[0].grad_norm has 4 values but layer table"),
    ("token column length", lambda: _edit(lambda m: m.steps[0].tokens.sample.append(1), [step_record(tokens=TokenStats(
        tokens=8, total_score=1.0, top=(TokenScore(micro_batch=0, sample=0, position=0, score=1.0, share=1.0),),
        top_share=1.0, micro_batch_shares=(), unattributed_share=0.0))]), "length_mismatch", "steps[0].tokens.sample"),
    ("unknown table", lambda: to_bytes([step_record()], tables=False), "unknown_layer_table", "resend the batch"),
    ("table id not its names", lambda: _edit(lambda m: m.layer_tables[0].names.append("extra")), "invalid_value",
     "layer_tables[0].id"),
    ("too many layers", lambda: _edit(lambda m: m.layer_tables.add(id=1, names=["x"] * 65537)), "invalid_value",
     "65537 layers"),
    ("incident schema", lambda: to_bytes([], [incident_record(schema_version=9)]), "schema_version",
     "incidents[0].schema_version is 9"),
    ("negative overhead seconds", lambda: to_bytes([step_record(overhead_s=-0.5)]), "invalid_value",
     "steps[0].overhead_seconds is -0.5"),
    ("too many shed features", lambda: to_bytes([step_record(shed=tuple(f"f{i}" for i in range(9)))]), "invalid_value",
     "steps[0].shed names 9 features"),
    ("negative sample index", lambda: to_bytes([], [incident_record(localization=replace(
        incident_record().localization, samples=(SampleShare(0, -1, 0.5),)))]), "invalid_value",
     "incidents[0].localization.samples[0].sample is -1"),
    ("huge world size", lambda: to_bytes([step_record()], client=client_info(world_size=2**62)), "invalid_value",
     f"client.world_size is {2**62} (must be in 1..65536)"),
    ("sequence beyond int64", lambda: _edit(lambda m: setattr(m, "sequence", 2**64 - 1)), "invalid_value",
     f"sequence is {2**64 - 1} (must be < 2**63)"),
    ("NaN band mean (the encoder never sends one)", lambda: _edit(lambda m: _band(m.steps[0], NAN, 2.0)), "nonfinite",
     "steps[0].norm_mean is nan"),
    ("infinite band line (the encoder never sends one)", lambda: _edit(lambda m: _band(m.steps[0], 1.0, INF)),
     "nonfinite", "steps[0].norm_threshold is inf"),
    ("half a band", lambda: _edit(lambda m: setattr(m.steps[0], "norm_mean", 1.0)), "invalid_value",
     "norm_mean and norm_threshold come together"),
    ("band line below its mean", lambda: to_bytes([step_record(norm_mean=2.0, norm_threshold=1.5)]), "invalid_value",
     "steps[0].norm_threshold 1.5 is below norm_mean 2.0"),
    ("negative band mean", lambda: to_bytes([step_record(norm_mean=-1.0, norm_threshold=1.0)]), "invalid_value",
     "steps[0].norm_mean is -1.0"),
    ("negative follows", lambda: to_bytes([], [incident_record(spike=replace(incident_record().spike, follows=-3))]),
     "invalid_value", "incidents[0].spike.follows is -3"),
    ("infinite remedy norm", lambda: to_bytes([], [incident_record(remedy=Remedy("drop_culprits", True, INF))]),
     "nonfinite", "incidents[0].remedy.norm_before"),
]


@pytest.mark.parametrize("what,make,reason,words", STRUCTURE, ids=[c[0] for c in STRUCTURE])
def test_structural_errors_are_rejected_with_a_message_naming_the_field(what, make, reason, words):
    err = rejected(make())
    assert (err.reason, words in err.message) == (reason, True), err.message


def test_largest_world_size_and_sequence_are_accepted():
    """The bounds found by the daemon fuzz (tests/reliability/test_fuzz.py): a larger world size made
    the correlator allocate range(world_size) per incident (MemoryError), a sequence >= 2**63 did not
    fit the inbox's SQLite INTEGER key (OverflowError -> INTERNAL). The bounds themselves pass."""
    msg, _ = encode([step_record(rank=65_535)], [incident_record(rank=65_535)], client=client_info(world_size=65_536, rank=0))
    msg.sequence = 2**63 - 1
    got = decode(msg.SerializeToString())
    assert (got.client.world_size, got.sequence, got.steps[0].rank) == (65_536, 2**63 - 1, 65_535)


def test_oversized_is_checked_before_parsing():
    data = to_bytes([step_record(i) for i in range(50)])
    err = rejected(data, BatchDecoder(max_message_bytes=len(data) - 1))
    assert err.reason == "oversized" and str(len(data)) in err.message
    assert len(decode(data, BatchDecoder(max_message_bytes=len(data))).steps) == 50


# -- all or nothing, and the layer-table cache --------------------------------------------------------
def test_a_rejected_batch_registers_no_table_and_a_later_batch_without_tables_is_refused():
    decoder = BatchDecoder()
    err = rejected(to_bytes([step_record(0), step_record(1, time_unix=NAN)]), decoder)
    assert err.reason == "nonfinite" and len(decoder.cache) == 0
    assert rejected(to_bytes([step_record(2)], tables=False), decoder).reason == "unknown_layer_table"
    assert len(decode(to_bytes([step_record(3)]), decoder).steps) == 1  # tables arrive → registered
    assert decode(to_bytes([step_record(4)], tables=False), decoder).steps[0].step == 4  # … and remembered


def test_layer_table_cache_is_a_bounded_lru():
    decoder = BatchDecoder(LayerTableCache(capacity=2))
    tables = [(f"a{i}", "b") for i in range(3)]
    recs = [step_record(i, layers=tuple(layer(n) for n in t)) for i, t in enumerate(tables)]
    decode(to_bytes([recs[0]]), decoder)
    decode(to_bytes([recs[1]]), decoder)
    decode(to_bytes([recs[0]], tables=False), decoder)  # touch table 0: table 1 is now the oldest
    decode(to_bytes([recs[2]]), decoder)
    assert len(decoder.cache) == 2
    assert decode(to_bytes([recs[0]], tables=False), decoder).steps
    assert rejected(to_bytes([recs[1]], tables=False), decoder).reason == "unknown_layer_table"


def test_decoded_columns_are_read_only_numpy_and_drops_are_reported():
    msg, _ = encode([step_record()])
    msg.drops.queue_full, msg.drops.rejected = 3, 1
    got = decode(msg.SerializeToString())
    cols = got.steps[0].layers
    assert cols.grad_norm.dtype == np.float64 and cols.numel.dtype == np.int64
    with pytest.raises(ValueError):
        cols.grad_norm[0] = 1.0
    assert dict(got.drops.items()) == {"queue_full": 3, "send_failed": 0, "encode_failed": 0, "rejected": 1}
    assert (got.client.job, got.client.rank, got.client.world_size, got.sequence) == (JOB, 1, 4, 1)


def test_encoder_refuses_a_negative_token_id_instead_of_changing_it():
    score = TokenScore(micro_batch=0, sample=0, position=0, score=1.0, share=1.0, token_id=-1)
    rec = step_record(tokens=TokenStats(tokens=8, total_score=1.0, top=(score,), top_share=1.0, micro_batch_shares=(),
                                 unattributed_share=0.0))
    with pytest.raises(RejectedBatch, match="negative token_id"):
        encode_step(rec, 1, {}, JOB, 1)


def test_decoding_is_columnar():
    """256 layers per step decode into one set of numpy columns per step (no Python object per layer):
    what keeps the daemon's decode budget (>= 5000 steps/s) affordable. The speed itself is measured by
    ``python -m bench agent`` (docs/BENCHMARKS.md §3), not asserted here: a wall-clock bound flakes on
    a loaded machine (this one measured 383 µs a step at load average 10, ~90 µs quiet)."""
    names = tuple(f"model.layers.{i // 8}.mlp.proj{i % 8}" for i in range(256))
    rng = np.random.default_rng(0)
    recs = [step_record(i, layers=tuple(layer(n, float(g)) for n, g in zip(names, rng.random(256) + 0.1)))
            for i in range(64)]
    batch = decode(to_bytes(recs), BatchDecoder())
    assert len(batch.steps) == 64
    for s in batch.steps:
        cols = s.layers
        assert cols.names == names
        for col in (cols.grad_norm, cols.grad_max_abs, cols.nonfinite, cols.param_norm):
            assert isinstance(col, np.ndarray) and col.shape == (256,)
    assert batch.steps[0].layers.names is batch.steps[-1].layers.names  # one names tuple per layer table


def test_an_overflowed_band_is_left_out_not_the_step():
    """The detector's band is auxiliary: a band that overflowed to inf must not get the step rejected."""
    got = decode(to_bytes([step_record(0, norm_mean=1e308, norm_threshold=INF)]))
    assert got.steps[0].step == 0 and (got.steps[0].norm_mean, got.steps[0].norm_threshold) == (None, None)
