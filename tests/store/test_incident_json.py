"""The CorrelatedIncident JSON codec: exact round trips (hand-built and generated), strict decoding."""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradloc.records import Incident, Localization, SampleInfo
from gradloc.reports import CorrelatedIncident, RankSpan
from gradloc.store.incident_json import correlated_from_dict, correlated_to_dict
from tests.builders import INCIDENT_ID, make_incident, nonfinite_incident


def _through_json(inc: CorrelatedIncident) -> CorrelatedIncident:
    text = json.dumps(correlated_to_dict(inc), allow_nan=False)  # strict JSON: no NaN literals
    return correlated_from_dict(json.loads(text))


def test_hand_built_incident_round_trips_to_an_equal_tree() -> None:
    inc = make_incident()
    back = _through_json(inc)
    assert back == inc
    assert isinstance(back.spans, tuple) and isinstance(back.spans[0], RankSpan)
    f0 = back.findings[0]
    assert isinstance(f0, Incident) and isinstance(f0.localization, Localization)
    assert f0.localization.spans[0].text == " bell" and f0.localization.spans[0].token_ids == (66,)
    assert isinstance(f0.localization.culprits[0].layers, tuple)
    assert back.findings[1].localization.explained_share is None
    assert back.ranks_missing == (2,) and back.spans[1].span.sample_id is None


def test_json_shape_is_the_documented_one() -> None:
    d = correlated_to_dict(make_incident())
    assert d["incident_id"] == INCIDENT_ID and d["ranks_missing"] == [2] and d["schema_version"] == 1
    assert d["spans"][0] == {"rank": 0, "share": pytest.approx(0.648), "span": {
        "micro_batch": 3, "sample": 1, "start": 41, "end": 42, "share": 0.9, "token_ids": [66], "text": " bell",
        "context_before": " climb the hill behind the school before the", "context_after": " rings. The old clock",
        "sample_id": "s1200-3-1", "sample_info": None, "rank": None, "window_start": 38,
        "window_tokens": [" school", " before", " the", " bell", " rings", "."],
        "window_scores": [0.001, 0.0, 0.02, 0.81, 0.05, 0.0]}}
    assert d["rank_shares"][1] == {"rank": 1, "share": 0.28, "global_norm": 3.5, "loss": 2.7, "flagged": True,
                                   "status": "unverified", "probes": 0}
    assert d["findings"][0]["localization"]["culprits"][0]["layers"][0] == {"layer": "head", "share": 0.29}
    assert set(d) == {f.name for f in dataclasses.fields(CorrelatedIncident)}


def test_non_finite_floats_travel_as_strings_and_come_back() -> None:
    inc = nonfinite_incident()
    d = correlated_to_dict(inc)
    assert d["global_norm"] == "nan" and d["rank_shares"][0]["global_norm"] == "inf"
    assert d["findings"][0]["spike"]["loss"] == "nan" and d["findings"][0]["top_layers"][0]["grad_max_abs"] == "inf"
    back = _through_json(inc)
    assert math.isnan(back.global_norm) and back.rank_shares[0].global_norm == math.inf
    assert back.findings[0].localization is None and back.findings[0].spike.z is None
    assert repr(back) == repr(inc)  # NaN != NaN, so compare the exact tree by its repr


def test_negative_infinity_and_ints_in_float_fields() -> None:
    d = correlated_to_dict(make_incident())
    d["global_norm"], d["closed_unix"] = "-inf", 1_760_000_005
    back = correlated_from_dict(d)
    assert back.global_norm == -math.inf
    assert type(back.closed_unix) is float and back.closed_unix == 1_760_000_005.0


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.pop("trace_id"), "missing field 'trace_id'"),
    (lambda d: d.update(colour="red"), "unknown field(s) ['colour']"),
    (lambda d: d.update(step="1200"), "$.step: expected an integer"),
    (lambda d: d.update(step=True), "$.step: expected an integer"),
    (lambda d: d.update(kinds="grad_spike"), "$.kinds: expected a list"),
    (lambda d: d["spans"][1]["span"].update(start=None), "$.spans[1].span.start: expected an integer"),
    (lambda d: d["findings"][0]["localization"].update(probes=2.0), "$.findings[0].localization.probes"),
    (lambda d: d["rank_shares"][0].update(flagged=1), "$.rank_shares[0].flagged: expected true/false"),
    (lambda d: d.update(global_norm="NaN"), '$.global_norm: expected a number or "nan"'),
    (lambda d: d.update(schema_version=2), "schema version 2 is newer than 1"),
    (lambda d: d["findings"][1].update(schema_version=9), "$.findings[1]: Incident schema version 9"),
])
def test_malformed_json_is_refused_with_its_path(mutate, message: str) -> None:
    d = correlated_to_dict(make_incident())
    mutate(d)
    with pytest.raises(ValueError) as err:
        correlated_from_dict(d)
    assert message in str(err.value)


def test_encoding_refuses_other_records() -> None:
    with pytest.raises(TypeError, match="expected a CorrelatedIncident"):
        correlated_to_dict(make_incident().findings[0])


# -- generated incidents: every field of every nested record, driven by the dataclasses' hints ------

def _strategy(tp: typing.Any) -> st.SearchStrategy:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is not None and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | _strategy(inner)
    if origin is tuple:
        return st.lists(_strategy(args[0]), max_size=2).map(tuple)
    if tp is SampleInfo:  # its provenance is checked on construction: the transport tests' valid ones
        from tests.transport.factories import infos

        return infos
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return st.builds(tp, **{f.name: _strategy(hints[f.name]) for f in dataclasses.fields(tp)
                                if f.name != "schema_version"})
    if isinstance(tp, type) and issubclass(tp, enum.Enum):  # records' StrEnums
        return st.sampled_from(list(tp))
    return {float: st.floats(), int: st.integers(-2**63, 2**63), bool: st.booleans(),
            str: st.text(max_size=6)}[tp]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_strategy(CorrelatedIncident))
def test_generated_incidents_round_trip_exactly(inc: CorrelatedIncident) -> None:
    back = _through_json(inc)
    assert repr(back) == repr(inc)  # same classes, tuples, float-vs-int, None, NaN and -0.0
    assert correlated_to_dict(back) == correlated_to_dict(inc)
