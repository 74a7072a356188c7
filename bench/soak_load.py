"""The soak's load generator: jobs of ``ranks`` clients that start, send on the clock and end.

``cfg.encode`` picks how a rank's step records become bytes:

* ``"client"``: the real :class:`~gradloc.transport.client.AgentClient` end to end (each record
  encoded and checked by the daemon's own validation in the client's worker thread, ~0.4 ms for a
  256-layer record on this machine: one core of clients tops out near 1,500 records/s);
* ``"replay"`` (default): :class:`ReplayClient`, the same AgentClient (its queue, batching,
  sequence numbers, retries, layer tables, drop counters and gRPC call), except that a rank's first
  step record of a layer layout is encoded and checked by the real codec **once**, and every later
  record is those bytes with its ``step`` and ``time_unix`` fields appended (a protobuf parser keeps
  the last value of a scalar field that occurs twice, so the daemon decodes exactly the record the real encoder
  would produce for that step and time; ``test_replay_bytes_decode_like_the_real_encoder`` checks
  it). The daemon's work per record is unchanged; the generator's drops to a few µs. Only the
  per-layer values stay those of the template, as they do with ``"client"`` too.
"""
from __future__ import annotations

import struct
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Self

from bench.agent import _off_daemon_cpu, template
from gradloc.records import CulpritSpan, Incident, Localization, SpikeEvent, StepRecord
from gradloc.transport.client import AgentClient
from gradloc.transport.client_link import Item
from gradloc.transport.codec import _varint, decode_step, encode_step
from gradloc.transport.wire import pb

_STEP_TAG = _varint(pb.Step.DESCRIPTOR.fields_by_name["step"].number << 3 | 0)  # varint
_TIME_TAG = _varint(pb.Step.DESCRIPTOR.fields_by_name["time_unix"].number << 3 | 1)  # 64-bit


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 10.0
    rate: float = 5000.0  # step records per second, all clients together
    layers: int = 256
    top_k: int = 16
    procs: int = 8  # client processes (one job slot each by default), on the cores the daemon does not use
    jobs_per_proc: int = 1
    ranks: int = 4
    job_s: float = 60.0  # how long a job runs before it ends and the next one starts
    job_retention_s: float = 15.0  # the daemon's --job-retention-s for the run
    straggler_deadline_s: float = 2.0
    incident_every: int = 1000  # steps of a job between two of its incidents
    max_backlog_s: float = 0.1  # a rank's steps more than this late are skipped (counted), not sent in a burst
    sample_s: float = 10.0
    # RSS is compared from min(warmup_s, 40% of the run) on: at 5,000/s the daemon's heap fills until
    # ~200-240 s and then stays flat (docs/BENCHMARKS.md §3.1), so an earlier window measures the fill
    warmup_s: float = 240.0
    daemon_cpu: int = 0
    encode: str = "replay"  # "replay": each rank's record encoded once, restamped; "client": encoded per record (bench/soak_load.py)

    def __post_init__(self) -> None:
        if not (self.minutes > 0 and self.rate > 0 and self.job_s > 0 and self.sample_s > 0):
            raise ValueError("minutes, rate, job_s and sample_s must be > 0")
        if self.warmup_s < 0:
            raise ValueError(f"warmup_s must be >= 0, got {self.warmup_s}")
        if min(self.procs, self.jobs_per_proc, self.ranks, self.incident_every) < 1:
            raise ValueError("procs, jobs_per_proc, ranks and incident_every must be >= 1")
        if self.encode not in ("replay", "client"):
            raise ValueError(f"encode must be 'replay' or 'client', got {self.encode!r}")

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def warmup_end_s(self) -> float:
        """Where the first RSS window starts; it and the last (each 10% of the run) never overlap."""
        return min(self.warmup_s, 0.4 * self.duration_s)

    @classmethod
    def quick(cls) -> Self:
        return cls(minutes=1 / 3, rate=400.0, layers=32, procs=2, jobs_per_proc=2, ranks=2, job_s=5.0,
                   job_retention_s=2.0, straggler_deadline_s=1.0, incident_every=100, sample_s=1.0)


def restamp(body: bytes, step: int, time_unix: float) -> bytes:
    """A serialized pb.Step with its ``step`` and ``time_unix`` (re)set: the fields appended last win."""
    return body + _STEP_TAG + _varint(step) + _TIME_TAG + struct.pack("<d", time_unix)


class ReplayClient(AgentClient):
    """An AgentClient whose step records are encoded once per layer layout and restamped after (see module doc)."""

    def __init__(self, address: str, **kw: Any) -> None:
        self._bodies: dict[tuple[str, ...], tuple[bytes, tuple[int, tuple[str, ...]]]] = {}
        super().__init__(address, **kw)

    def _encode(self, record: object) -> None:
        if not isinstance(record, StepRecord) or record.step < 0:
            return super()._encode(record)
        names = tuple(s.layer for s in record.layers)
        if names not in self._bodies:
            cfg = self.config
            table_id, index = self._tables.lookup(names)
            msg = encode_step(record, table_id, index, cfg.job, cfg.rank)
            decode_step(msg, names, cfg.job, cfg.rank, cfg.world_size, f"step {record.step}", False)
            msg.ClearField("step")
            msg.ClearField("time_unix")
            self._bodies[names] = (msg.SerializeToString(), (table_id, names))
        body, table = self._bodies[names]
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(Item(restamp(body, record.step, record.time_unix), table))
        if len(self._pending) > self.config.queue_size:
            self._pending.popleft()
            self._resolve("send_failed", 1)


def incident(job: str, rank: int, step: int) -> Incident:
    spike = SpikeEvent(step=step, kinds=("grad_spike",), global_norm=50.0, z=12.0, mean=1.0, std=0.3,
                       layers=("model.layers.0.mlp.proj0",))
    span = CulpritSpan(0, 1, 7, 9, 0.8, (42, 43), " bad", "before", "after", f"{job}-{step}")
    loc = Localization(step=step, method="attribution", status="located", level="span", probes=2,
                       explained_share=0.8, global_norm=50.0, culprit_norm=40.0, norm_without_culprits=10.0,
                       spans=(span,))
    return Incident(incident_id=uuid.uuid4().hex, job=job, rank=rank, step=step, time_unix=time.time(), spike=spike,
                    localization=loc)


class Job:
    """One job of ``ranks`` AgentClients in a slot; sends on the clock, ``per_rank`` records/s each."""

    def __init__(self, address: str, name: str, cfg: SoakConfig, per_rank: float) -> None:
        self.name, self.cfg, self.per_rank = name, cfg, per_rank
        self.started = self.ends = 0.0  # set by the slot once the clients are up
        client_cls = ReplayClient if cfg.encode == "replay" else AgentClient
        self.clients = [client_cls(address, job=name, rank=r, world_size=cfg.ranks) for r in range(cfg.ranks)]
        self.base = [replace(template(cfg.layers, cfg.top_k, r), job=name) for r in range(cfg.ranks)]
        self.sent = [0] * cfg.ranks  # records (= steps) sent by each rank
        self.slots = [0] * cfg.ranks  # send slots passed (sent or skipped) of each rank
        self.incidents = self.skipped = 0

    def pump(self, now: float) -> int:
        """Send what is due by ``now``; returns how many records. Like a trainer, a rank that fell
        behind (this process did not get the CPU) does not send its missed steps in a burst: beyond
        ``max_backlog_s`` of them they are skipped, and counted."""
        due = int((now - self.started) * self.per_rank)
        n = 0
        for r, client in enumerate(self.clients):
            behind = due - self.slots[r] - max(1, int(self.per_rank * self.cfg.max_backlog_s))
            if behind > 0:
                self.slots[r] += behind
                self.skipped += behind
            while self.slots[r] < due:
                step = self.sent[r]
                client.on_step(replace(self.base[r], step=step, time_unix=time.time()))
                if r == 0 and step % self.cfg.incident_every == self.cfg.incident_every // 2:
                    client.on_incident(incident(self.name, 0, step))
                    self.incidents += 1
                self.sent[r] += 1
                self.slots[r] += 1
                n += 1
        return n

    def finish(self) -> Counter[str]:
        """End the job: one last incident for a step no rank records (partial), then shut the clients down."""
        self.clients[0].on_incident(incident(self.name, 0, max(self.sent) + 1))
        self.incidents += 1
        counts: Counter[str] = Counter({"offered_steps": sum(self.sent), "skipped_slots": self.skipped})
        for client in self.clients:
            client.shutdown(30)
            counts.update(client.counters)
        counts["jobs"] += 1
        counts["incidents"] += self.incidents
        return counts


def load_proc(address: str, cfg: SoakConfig, idx: int, start: Any, out: Any, ready: Any) -> None:
    _off_daemon_cpu(cfg)
    per_rank = cfg.rate / (cfg.procs * cfg.jobs_per_proc * cfg.ranks)
    n_slots = cfg.procs * cfg.jobs_per_proc
    ready.put(idx)
    start.wait()
    t0 = time.monotonic()
    end = t0 + cfg.duration_s
    counts: Counter[str] = Counter()
    gen = [0] * cfg.jobs_per_proc

    def new_job(s: int, length: float) -> Job:
        gen[s] += 1
        job = Job(address, f"soak-p{idx}-s{s}-g{gen[s]}", cfg, per_rank)
        job.started = time.monotonic()  # once its clients are up, like a trainer's first step
        job.ends = min(end, job.started + length)
        return job

    # staggered first jobs: the slots' jobs end at different times, not all at once
    slots = [new_job(s, cfg.job_s * (idx * cfg.jobs_per_proc + s + 1) / n_slots) for s in range(cfg.jobs_per_proc)]
    while True:
        now = min(time.monotonic(), end)
        for s, job in enumerate(slots):
            if now >= job.ends and job.ends < end:  # ended before the run did: the slot's next job starts
                job.pump(job.ends)
                counts.update(job.finish())
                slots[s] = new_job(s, cfg.job_s)
        sent = sum(job.pump(now) for job in slots)
        if now >= end:
            break
        if not sent:
            time.sleep(0.002)
    for job in slots:
        counts.update(job.finish())
    out.put(dict(counts))
