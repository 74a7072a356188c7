"""Every bad-input class through a real gRPC server on 127.0.0.1:0: the right status code and message,
one counted rejection, and the server still takes a good batch afterwards. No mocks."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from gradloc.transport import Overloaded

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.*` under plain `pytest` too
from tests.builders import incident_record, layer, step_record  # noqa: E402
from tests.transport.factories import NAN, Receiver, client_info, encode, to_bytes  # noqa: E402

LIMIT = 256 * 1024
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture
def daemon():
    d = Receiver(max_message_bytes=LIMIT)
    yield d
    d.close()


def _edit(edit) -> bytes:
    msg, _ = encode([step_record(0)])
    edit(msg)
    return msg.SerializeToString()


BAD = [  # (what, batch bytes, status, reason, words in the details)
    ("malformed bytes", lambda: b"\x0a\xff\xff\xff\xff garbage", INVALID, "malformed", "not a gradloc.v1.IngestBatch"),
    ("oversized", lambda: to_bytes([step_record(i, layers=tuple(layer(f"layer.{j}") for j in range(300)))
                                    for i in range(60)]), grpc.StatusCode.RESOURCE_EXHAUSTED, "oversized",
     f"more than the {LIMIT}"),
    ("unknown schema version", lambda: to_bytes([step_record()], schema_version=7), INVALID, "schema_version",
     "this daemon speaks [1]"),
    ("NaN time", lambda: to_bytes([step_record(time_unix=NAN)]), INVALID, "nonfinite", "steps[0].time_unix is nan"),
    ("nonfinite norm without a nonfinite count", lambda: to_bytes([step_record(layers=(layer("a"), layer("b", NAN)))]),
     INVALID, "nonfinite", "steps[0].grad_norm[1] (layer 'b') is nan but the layer's nonfinite count is 0"),
    ("mismatched array lengths", lambda: _edit(lambda m: m.steps[0].numel.pop()), INVALID, "length_mismatch",
     "steps[0].numel has 2 values"),
    ("unknown layer table", lambda: to_bytes([step_record()], tables=False), PRECONDITION, "unknown_layer_table",
     "resend the batch with its layer tables"),
    ("rank >= world size", lambda: to_bytes([step_record()], client=client_info(rank=4, world_size=4)), INVALID,
     "invalid_value", "client.rank is 4, outside [0, world_size=4)"),
]


@pytest.mark.parametrize("what,make,code,reason,words", BAD, ids=[c[0] for c in BAD])
def test_bad_batch_gets_its_status_and_a_counted_reason_and_the_server_keeps_serving(daemon, what, make, code,
                                                                                      reason, words):
    err = daemon.refused(make())
    assert err.code() == code, err
    assert err.details().startswith(f"{reason}: ") and words in err.details(), err.details()
    assert daemon.rejects == [reason] and daemon.batches == []
    reply = daemon.send(to_bytes([step_record(1), step_record(2)]))
    assert (reply.accepted_steps, reply.accepted_incidents) == (2, 0)
    assert [s.step for s in daemon.batches[0].steps] == [1, 2] and daemon.rejects == [reason]


def test_grpc_own_limit_is_above_ours_so_our_check_counts_it(daemon):
    err = daemon.refused(b"\x00" * (LIMIT * 2))  # twice our limit: still reaches our check
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and daemon.rejects == ["oversized"]


def test_a_handler_exception_is_internal_and_counted_and_overload_asks_for_a_retry(daemon):
    daemon.fail = RuntimeError("store is on fire")
    err = daemon.refused(to_bytes([step_record()]))
    assert err.code() == grpc.StatusCode.INTERNAL and "store is on fire" in err.details()
    daemon.fail = Overloaded("queue full")
    err = daemon.refused(to_bytes([step_record()]))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and err.details().startswith("overloaded")
    assert daemon.rejects == ["internal", "overloaded"]
    daemon.fail = None
    assert daemon.send(to_bytes([step_record(5)])).accepted_steps == 1


def test_layer_tables_are_remembered_between_batches_and_clients(daemon):
    daemon.send(to_bytes([step_record(0)]))  # tables included
    other = client_info(client_id="another-client", rank=2)
    reply = daemon.send(to_bytes([step_record(1, rank=2)], tables=False, client=other))  # same names: same table id
    assert reply.accepted_steps == 1 and daemon.batches[1].client.client_id == "another-client"


def test_incidents_and_client_identity_arrive(daemon):
    inc = incident_record()
    inc = replace(inc, localization=replace(inc.localization, note="n"))
    reply = daemon.send(to_bytes([], [inc]))
    assert (reply.accepted_steps, reply.accepted_incidents) == (0, 1)
    (batch,) = daemon.batches
    assert batch.incidents == (inc,) and batch.client.hostname == "host" and batch.client.pid == 123
