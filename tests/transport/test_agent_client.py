"""AgentClient against real gRPC servers (or none): the training thread never waits or sees an error,
every dropped record is counted, and records reach a daemon that comes up late or restarts."""
from __future__ import annotations

import random
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest

from gradloc.demo.spawn import free_port
from gradloc.errors import ConfigError
from gradloc.transport import AgentClient, LayerTableCache, Overloaded

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.*` under plain `pytest` too
from tests.builders import JOB, incident_record, layer, step_record  # noqa: E402
from tests.transport.factories import NAN, Receiver  # noqa: E402

FAST = dict(world_size=4, flush_interval_s=0.02, timeout_s=2.0, backoff_initial_s=0.02, backoff_max_s=0.1)


def client(address: str, **kw) -> AgentClient:
    return AgentClient(address, job=JOB, rank=1, **{**FAST, **kw})


def wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


class Blocker:
    """A record whose encoding blocks until released (so the worker stalls and the queue fills),
    then fails (counted as ``encode_failed``). The only way to stall the real worker from outside."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        self.entered.set()
        self.release.wait(10)
        raise AttributeError(name)


# -- config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(job=""), dict(rank=4), dict(rank=-1), dict(world_size=0), dict(world_size=65_537), dict(queue_size=0),
                                dict(max_batch=0), dict(flush_interval_s=0), dict(timeout_s=-1),
                                dict(backoff_initial_s=2.0, backoff_max_s=1.0), dict(address="nohostport")])
def test_config_is_validated_on_construction(kw):
    args = {**dict(address="127.0.0.1:1", job=JOB, rank=1, world_size=4), **kw}
    with pytest.raises(ConfigError):
        AgentClient(args.pop("address"), **args)


# -- the training thread -------------------------------------------------------------------------------
@pytest.mark.wallclock  # asserts a wall-clock bound (tests/conftest.py: never beside a multi-process test)
def test_without_a_server_on_step_is_fast_and_nothing_raises():
    c = client(f"127.0.0.1:{free_port()}", timeout_s=0.2)
    rec = step_record(layers=(layer("a"),))
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        c.on_step(rec)
        times.append(time.perf_counter() - t0)
    c.on_step(None)  # not a record: counted when the worker fails to encode it, never raised
    c.on_incident("nonsense")
    # Median and mean, not max: a single call can wait a GIL switch interval (5 ms) while the worker
    # thread encodes, which is the interpreter's scheduling, not work done by on_step.
    assert statistics.median(times) < 1e-4 and statistics.mean(times) < 5e-4, (statistics.median(times), max(times))
    assert wait_for(lambda: c.counters["encode_failed"] == 2 and c.counters["reconnects"] >= 1)
    assert c.force_flush(0.2) is False  # nobody is listening
    t0 = time.monotonic()
    c.shutdown(0.3)
    assert time.monotonic() - t0 < 2.0
    counts = c.counters
    assert counts["sent_steps"] == 0 and counts["send_failed"] == 300 and counts["queue_full"] == 0


@pytest.mark.wallclock  # asserts a wall-clock bound (tests/conftest.py: never beside a multi-process test)
def test_shutdown_abandons_a_call_begun_before_it_and_the_worker_ends():
    """A stalled daemon (a socket that listens and never answers): the hello is in flight with the
    full 30 s timeout_s when shutdown begins. Shutdown cancels it at its own deadline, so the worker
    thread ends too and no call is left for interpreter exit to wait on."""
    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(16)
        c = client(f"127.0.0.1:{stalled.getsockname()[1]}", timeout_s=30.0)
        c.on_step(step_record(0))
        assert wait_for(lambda: c._link.in_call)  # the hello's call is out (internal: nothing else shows it)
        t0 = time.monotonic()
        c.shutdown(0.3)
        took = time.monotonic() - t0
        assert not c._thread.is_alive(), "the worker is still in the call"
        assert took < 0.3 + 1.0, took  # the budget, plus slack for a loaded machine
        assert c.counters["send_failed"] == 1 and c.counters["sent_steps"] == 0


def test_queue_full_drops_are_counted_exactly_and_reported_to_the_daemon(receiver):
    c = client(receiver.address, queue_size=8)
    blocker = Blocker()
    c.on_incident(blocker)
    assert blocker.entered.wait(5)  # the worker is stuck encoding it; the queue is empty
    for i in range(8 + 5):
        c.on_step(step_record(i))
    assert c.counters["queue_full"] == 5
    blocker.release.set()
    assert c.force_flush(10)
    counts = c.counters
    assert (counts["sent_steps"], counts["queue_full"], counts["encode_failed"]) == (8, 5, 1)
    assert [s.step for s in receiver.steps] == list(range(8))
    assert dict(receiver.batches[-1].drops.items()) == {"queue_full": 5, "send_failed": 0, "encode_failed": 1,
                                                        "rejected": 0}
    c.shutdown(5)


def test_ids_and_jitter_do_not_follow_the_seeded_module_random():
    random.seed(0)
    a = client("127.0.0.1:1")
    random.seed(0)
    b = client("127.0.0.1:1")
    try:
        assert a.client_info.client_id != b.client_info.client_id
        assert a._rng.random() != b._rng.random()  # the backoff jitter's own generator
    finally:
        a.shutdown(0.1)
        b.shutdown(0.1)


# -- delivery ------------------------------------------------------------------------------------------
def test_the_daemon_hears_of_the_rank_at_construction_before_any_record(receiver):
    """A job-scope incident waits for the ranks the daemon has heard from: a rank must not stay
    unheard of until its first flush (a short DDP run sends everything at close)."""
    c = client(receiver.address, flush_interval_s=60.0)
    assert wait_for(lambda: len(receiver.batches) == 1)
    (hello,) = receiver.batches
    assert (hello.client.job, hello.client.rank, hello.sequence) == (JOB, 1, 1)
    assert hello.steps == () and hello.incidents == () and c.counters["sent_steps"] == 0
    c.on_step(step_record(0))
    assert c.force_flush(10) and [b.sequence for b in receiver.batches] == [1, 2]
    c.shutdown(5)


def test_a_server_started_later_receives_everything_after_backoff():
    port = free_port()
    c = client(f"127.0.0.1:{port}")
    for i in range(10):
        c.on_step(step_record(i))
    assert wait_for(lambda: c.counters["reconnects"] >= 2)
    late = Receiver(port=port)
    try:
        assert c.force_flush(15)
        assert [s.step for s in late.steps] == list(range(10))
        hello, first = late.batches[:2]  # the hello, resent like any batch, then the records
        assert (hello.sequence, hello.steps, hello.incidents) == (1, (), ())
        assert first.steps[0].layers.names == ("embed", "blocks.0.mlp", "head")
        counts = c.counters
        assert (counts["sent_steps"], counts["send_failed"], counts["rejected"]) == (10, 0, 0)
        c.shutdown(5)
    finally:
        late.close()


def test_a_restarted_daemon_gets_the_layer_tables_again():
    first = Receiver()
    c = client(first.address)
    c.on_step(step_record(0))
    assert c.force_flush(10) and [s.step for s in first.steps] == [0]
    first.close()
    second = Receiver(port=first.port)
    try:
        c.on_step(step_record(1))
        assert c.force_flush(15)
        assert [s.step for s in second.steps] == [1] and c.counters["rejected"] == 0
        c.shutdown(5)
    finally:
        second.close()


def test_a_daemon_that_forgot_the_tables_answers_failed_precondition_and_gets_them(receiver):
    c = client(receiver.address)
    c.on_step(step_record(0))
    assert c.force_flush(10)
    receiver.decoder.cache = LayerTableCache()  # as if the table aged out of the daemon's cache
    c.on_step(step_record(1))
    assert c.force_flush(10)
    assert [s.step for s in receiver.steps] == [0, 1] and receiver.rejects == ["unknown_layer_table"]
    assert (c.counters["rejected"], c.counters["reconnects"]) == (0, 0)
    c.shutdown(5)


def test_an_overloaded_daemon_gets_the_batch_again_later(receiver):
    receiver.fail = Overloaded("queue full")
    c = client(receiver.address)
    c.on_step(step_record(0))
    assert wait_for(lambda: len(receiver.rejects) >= 2)
    receiver.fail = None
    assert c.force_flush(10)
    assert [s.step for s in receiver.steps] == [0]
    # each batch accepted once, with the sequence number it was first sent with: the hello, then the step
    assert [(b.sequence, len(b.steps)) for b in receiver.batches] == [(1, 0), (2, 1)]
    assert (c.counters["sent_steps"], c.counters["reconnects"], c.counters["send_failed"]) == (1, 0, 0)
    c.shutdown(5)


def test_refused_batches_and_invalid_records_are_dropped_and_counted():
    r = Receiver(max_message_bytes=4096)
    try:
        c = client(r.address)
        c.on_step(step_record(0, layers=tuple(layer(f"model.layers.{i}.mlp") for i in range(100))))  # > 4096 bytes
        assert c.force_flush(10) and r.rejects == ["oversized"]
        c.on_step(step_record(1, time_unix=NAN))  # the daemon would reject it: dropped here, alone
        c.on_step(step_record(2))
        assert c.force_flush(10)
        assert [s.step for s in r.steps] == [2] and r.rejects == ["oversized"]
        assert (c.counters["rejected"], c.counters["sent_steps"]) == (2, 1)
        c.shutdown(5)
    finally:
        r.close()


def test_shutdown_flushes_then_later_records_are_counted_not_sent(receiver):
    c = client(receiver.address, flush_interval_s=60.0)  # nothing leaves before the flush
    for i in range(5):
        c.on_step(step_record(i))
    c.on_incident(incident_record())
    c.shutdown(10)
    assert [s.step for s in receiver.steps] == list(range(5))
    assert [i.step for b in receiver.batches for i in b.incidents] == [7]
    assert not c._thread.is_alive()
    c.on_step(step_record(5))
    c.shutdown(10)  # a no-op
    counts = c.counters
    assert (counts["sent_steps"], counts["sent_incidents"], counts["after_shutdown"]) == (5, 1, 1)


def test_while_the_daemon_is_away_the_newest_records_are_kept_and_the_oldest_counted():
    port = free_port()
    c = client(f"127.0.0.1:{port}", queue_size=8, max_batch=4)
    for i in range(20):
        c.on_step(step_record(i))
        assert wait_for(lambda: c._queue.empty())  # let the worker take it: no queue_full in this test
    late = Receiver(port=port)
    try:
        assert c.force_flush(15)
        got = [s.step for s in late.steps]
        counts = c.counters
        # kept: the batch being retried (<= max_batch) and the newest queue_size records
        assert got == sorted(got) and got[-8:] == list(range(12, 20)) and len(got) <= 4 + 8
        assert counts["sent_steps"] + counts["send_failed"] == 20 and counts["queue_full"] == 0
        c.shutdown(5)
    finally:
        late.close()
