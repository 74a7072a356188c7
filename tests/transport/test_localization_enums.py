"""The localization's typed fields on the wire: status, method and level decode to records' StrEnums;
anything else is refused with a short message (a gRPC status message travels in a trailer of at
most 16 KiB: a 65,537-character value echoed whole turned INVALID_ARGUMENT into RESOURCE_EXHAUSTED
in the ingest fuzz)."""
from __future__ import annotations

import pytest

from gradloc.records import Level, Method, Status
from gradloc.transport.codec import BatchDecoder
from gradloc.transport.validate import RejectedBatch
from tests.builders import incident_record
from tests.transport.factories import encode


def _decode(field: str, value: str):
    msg, _ = encode([], [incident_record()])
    setattr(msg.incidents[0].localization, field, value)
    return BatchDecoder().decode(msg.SerializeToString())


@pytest.mark.parametrize("field, kind", [("status", Status), ("method", Method), ("level", Level)])
def test_every_value_decodes_to_its_enum(field: str, kind: type) -> None:
    for value in kind:
        (inc,) = _decode(field, value.value).incidents
        got = getattr(inc.localization, field)
        assert got is value and isinstance(got, kind)


@pytest.mark.parametrize("field", ["status", "method", "level"])
@pytest.mark.parametrize("value", ["locatd", "y" * 65_537, "LOCATED"])
def test_other_values_are_refused_with_a_short_message(field: str, value: str) -> None:
    with pytest.raises(RejectedBatch) as err:
        _decode(field, value)
    assert err.value.reason == "invalid_value"
    assert f"localization.{field}" in str(err.value) and len(str(err.value)) < 300
