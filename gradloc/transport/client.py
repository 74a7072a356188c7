"""The trainer's side of the transport: a sink that sends records to the ``gradloc-agent`` daemon.

The training thread only ever does ``queue.put_nowait`` (a full queue drops the record and counts
``queue_full``); it never blocks on the network and never sees an exception. One daemon thread
does everything else: batches (``max_batch`` records or ``flush_interval_s``), encodes and checks
each record with the daemon's own validation (a bad record is dropped and counted alone instead of
getting its whole batch rejected), and sends with a deadline.

Failures, by the daemon's status code:

* ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED``: keep the batch, reconnect (a fresh channel, counted in
  ``reconnects``) after an exponential backoff with full jitter, and resend it with the same
  sequence number. Meanwhile new records keep being encoded into a buffer bounded by
  ``queue_size``; beyond it the oldest are dropped and counted as ``send_failed``.
* ``INVALID_ARGUMENT`` / ``RESOURCE_EXHAUSTED``: the batch is dropped, its records counted ``rejected``.
* ``FAILED_PRECONDITION`` (the daemon does not know a layer table: it restarted, or the table aged
  out of its cache): resend once with every table the batch uses.
* anything else (e.g. ``INTERNAL``): dropped, counted ``send_failed`` (no retry loop on a poison batch).

The first batch is empty and goes at construction (``watch()`` time): it tells the daemon that this
rank of the job exists before any of its records do. A job-scope incident (DDP, ZeRO) waits for the
ranks the daemon has heard from, so a rank whose first records would only come with its first
flush could otherwise be left out of the incident's rank shares.

Layer tables go in the first batch after every (re)connect and whenever a new one appears. The
cumulative drop counters go in every batch. Jitter uses its own ``random.Random`` seeded from
``os.urandom``: training scripts seed the module-level ``random``, and every rank would otherwise
retry in lockstep.
"""
from __future__ import annotations

import logging
import os
import queue
import random
import socket
import threading
import time
import uuid
from collections import Counter, deque

import grpc

from gradloc.records import Incident, StepRecord
from gradloc.transport.client_config import ClientConfig
from gradloc.transport.client_link import RETRY, IngestLink, Item
from gradloc.transport.codec import LayerTables, decode_incident, decode_step, encode_incident, encode_step
from gradloc.transport.validate import RejectedBatch
from gradloc.transport.wire import pb

log = logging.getLogger(__name__)

_REJECTED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED})
_WAKE = object()  # queued by force_flush/shutdown to wake the worker (never counted)
COUNTERS = ("sent_steps", "sent_incidents", "queue_full", "send_failed", "encode_failed", "rejected",
            "reconnects", "after_shutdown")


class AgentClient:
    """A sink (``on_step / on_incident / force_flush / shutdown``) that streams to the daemon."""

    def __init__(self, address: str, *, job: str, rank: int, **options: object) -> None:
        self.config = cfg = ClientConfig(address, job, rank, **options)  # type: ignore[arg-type]
        from gradloc import __version__

        self.client_info = pb.ClientInfo(job=cfg.job, rank=cfg.rank, world_size=cfg.world_size,
                                         client_id=uuid.UUID(bytes=os.urandom(16)).hex,
                                         hostname=socket.gethostname()[:256], pid=os.getpid(),
                                         gradloc_version=__version__)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=cfg.queue_size)
        self._counts: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self._cond = threading.Condition()  # guards the counts, _accepted/_resolved, _flush_target
        self._accepted = self._resolved = self._flush_target = 0
        self._closed = False
        self._stop_at: float | None = None  # monotonic deadline once shutdown began
        self._rng = random.Random(os.urandom(16))
        # -- worker-thread state --
        self._tables = LayerTables()
        self._pending: deque[Item] = deque()
        self._pending_since = 0.0
        self._seq = 1
        # (sequence, items) being (re)sent; first the hello, an empty batch (see the module docstring)
        self._inflight: tuple[int, list[Item]] | None = (1, [])
        self._attempt, self._retry_at, self._reconnect = 0, 0.0, False
        self._warned: Counter[str] = Counter()
        self._link = IngestLink(cfg, self.client_info, self._cond, self._warn)
        self._link.connect()
        self._thread = threading.Thread(target=self._run, name="gradloc-agent-client", daemon=True)
        self._thread.start()

    # -- the training thread's side: enqueue only --------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        self._offer(record)

    def on_incident(self, incident: Incident) -> None:
        self._offer(incident)

    def _offer(self, record: object) -> None:
        try:
            if self._closed:
                self._add("after_shutdown")
                return
            self._queue.put_nowait(record)
            with self._cond:
                self._accepted += 1
        except queue.Full:
            self._add("queue_full")
        except Exception:  # never raise into training
            self._add("encode_failed")

    @property
    def queued(self) -> int:
        """Records waiting in the queue (not yet taken by the background thread)."""
        return self._queue.qsize()

    @property
    def counters(self) -> dict[str, int]:
        with self._cond:
            return dict(self._counts)

    def force_flush(self, timeout_s: float | None = None) -> bool:
        """Send everything accepted so far; True when all of it was sent (or dropped for a reason
        other than the daemon being unreachable) within ``timeout_s`` (default: ``timeout_s`` of the config)."""
        with self._cond:
            target = self._accepted
            self._flush_target = max(self._flush_target, target)
        self._wake()
        with self._cond:
            return self._cond.wait_for(lambda: self._resolved >= target,
                                       self.config.timeout_s if timeout_s is None else timeout_s)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Flush what can be sent within ``timeout_s``, then stop the worker. Idempotent. Returns
        within ``timeout_s`` plus a few milliseconds whatever the daemon does (down, stalled, slow):
        a call begun after shutdown has the same deadline, one begun before it is cancelled there, so
        the worker ends too; what is left is dropped and counted (``send_failed``)."""
        if self._closed:
            return
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        with self._cond:
            self._closed = True
            self._stop_at = start + timeout  # bounds the worker's in-flight call too
        self.force_flush(timeout)
        self._wake()
        self._thread.join(max(0.0, start + timeout - time.monotonic()))
        self._link.cancel()  # past the deadline: a call still out (one begun before shutdown) is abandoned
        self._thread.join(0.05)

    def close_within(self, timeout_s: float) -> int:
        """``Monitor.close``'s entry point: flush and stop within ``timeout_s``. Returns how many
        accepted records were not delivered (dropped, or still in a call the deadline abandoned)."""
        self.shutdown(timeout_s)
        with self._cond:
            c = self._counts
            undelivered = self._accepted - self._resolved + c["send_failed"] + c["queue_full"] + c["after_shutdown"]
        return undelivered

    # -- worker thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._tick():
                    break
            except Exception:  # never let the worker die (and never spin on a persistent bug)
                self._warn("worker", "gradloc: agent client worker error", exc_info=True)
                time.sleep(0.05)
        self._drop_all()
        self._link.close()

    def _tick(self) -> bool:
        now = time.monotonic()
        with self._cond:
            stop_at, urgent = self._stop_at, self._flush_target > self._resolved
        if stop_at is not None and (now >= stop_at or not (self._inflight or self._pending or self._queue.qsize())):
            return False
        send_at = self._send_time(now, urgent or stop_at is not None)
        if now >= send_at:
            self._send()
        else:
            self._drain(min(send_at, stop_at or send_at, now + 0.5) - now)
        return True

    def _send_time(self, now: float, urgent: bool) -> float:
        if not (self._inflight or self._pending):
            return float("inf")
        due = now if urgent or self._inflight or len(self._pending) >= self.config.max_batch \
            else self._pending_since + self.config.flush_interval_s
        return max(due, self._retry_at)

    def _drain(self, timeout: float) -> None:
        """Encode what is queued (at most one batch's worth), waiting up to ``timeout`` for the first."""
        records: list[object] = []
        try:
            records.append(self._queue.get(timeout=timeout))
            while len(records) < self.config.max_batch:
                records.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        for record in records:
            if record is not _WAKE:
                self._encode(record)

    def _encode(self, record: object) -> None:
        cfg = self.config
        try:
            if isinstance(record, StepRecord):
                names = tuple(s.layer for s in record.layers)
                table_id, index = self._tables.lookup(names)
                msg = encode_step(record, table_id, index, cfg.job, cfg.rank)
                decode_step(msg, names, cfg.job, cfg.rank, cfg.world_size, f"step {record.step}", False)  # the daemon's checks
                item = Item(msg.SerializeToString(), (table_id, names))
            else:
                msg = encode_incident(record)  # type: ignore[arg-type]
                decode_incident(msg, cfg.world_size, f"incident of step {record.step}")  # type: ignore[attr-defined]
                item = Item(msg.SerializeToString(), None)
        except RejectedBatch as exc:
            self._warn("invalid", "gradloc: not sending a record the agent would reject: %s", exc)
            return self._resolve("rejected", 1)
        except Exception:
            self._warn("encode", "gradloc: could not encode a record for the agent", exc_info=True)
            return self._resolve("encode_failed", 1)
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(item)
        if len(self._pending) > cfg.queue_size:  # the daemon has been away: keep the newest
            self._pending.popleft()
            self._resolve("send_failed", 1)

    def _take_batch(self) -> tuple[int, list[Item]]:
        items, size = [], 0
        while self._pending and len(items) < self.config.max_batch:
            if items and size + len(self._pending[0].data) > self.config.max_batch_bytes:
                break
            items.append(self._pending.popleft())
            size += len(items[-1].data)
        self._pending_since = time.monotonic()
        self._seq += 1
        return self._seq, items

    def _send(self) -> None:
        if self._reconnect:
            self._add("reconnects")
            self._link.connect()
            self._reconnect = False
        self._inflight = self._inflight or self._take_batch()
        code, details = self._try_send()
        if code == grpc.StatusCode.FAILED_PRECONDITION:  # the daemon lost our tables: send them all
            self._link.sent_tables.clear()
            code, details = self._try_send()
        seq, items = self._inflight
        if code in RETRY:
            self._attempt += 1
            cap = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2 ** min(self._attempt - 1, 30))
            self._retry_at = time.monotonic() + self._rng.uniform(0.0, cap)  # full jitter
            self._reconnect = not details.startswith("overloaded")  # an overloaded daemon is still there
            return
        self._inflight, self._attempt, self._retry_at = None, 0, 0.0
        if code is None:
            steps = sum(1 for it in items if it.table is not None)
            with self._cond:
                self._counts["sent_steps"] += steps
                self._counts["sent_incidents"] += len(items) - steps
            self._resolve(None, len(items))
        else:
            self._resolve("rejected" if code in _REJECTED else "send_failed", len(items))

    def _try_send(self) -> tuple[grpc.StatusCode | None, str]:
        """One attempt of the batch in flight, with the cumulative drop counts; (None, "") on success."""
        seq, items = self._inflight  # type: ignore[misc]
        with self._cond:
            c = self._counts
            drops = pb.ClientDrops(queue_full=c["queue_full"], send_failed=c["send_failed"],
                                   encode_failed=c["encode_failed"], rejected=c["rejected"])
        timeout = self.config.timeout_s
        if self._stop_at is not None:
            timeout = max(0.05, min(timeout, self._stop_at - time.monotonic()))
        return self._link.send(seq, items, drops, timeout, stopping=self._stop_at is not None)

    def _drop_all(self) -> None:
        """At exit: whatever was not sent by the shutdown deadline is dropped (``send_failed``)."""
        left = len(self._pending) + (len(self._inflight[1]) if self._inflight else 0)
        while True:
            try:
                left += self._queue.get_nowait() is not _WAKE
            except queue.Empty:
                break
        self._pending.clear()
        self._inflight = None
        if left:
            self._resolve("send_failed", left)

    # -- bookkeeping -------------------------------------------------------------------------------
    def _add(self, key: str, n: int = 1) -> None:
        with self._cond:
            self._counts[key] += n

    def _resolve(self, key: str | None, n: int) -> None:
        with self._cond:
            if key is not None:
                self._counts[key] += n
            self._resolved += n
            self._cond.notify_all()

    def _wake(self) -> None:
        try:
            self._queue.put_nowait(_WAKE)
        except queue.Full:
            pass  # a full queue wakes the worker by itself

    def _warn(self, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        self._warned[key] += 1
        n = self._warned[key]
        if n <= 3 or n % 1000 == 0:
            log.warning(msg + (" (%d times so far)" % n if n > 1 else ""), *args, exc_info=exc_info)
