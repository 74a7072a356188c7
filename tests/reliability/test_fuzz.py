"""Fuzz of a live ``gradloc-agent`` daemon: malformed and extreme ingest messages, and HTTP API targets.

Everything is real: this checkout's daemon (``python -m gradloc.agent.cli serve``, a subprocess with
its own SQLite store), raw gRPC calls on a real channel, raw HTTP requests on a real socket. The
daemon runs under a 4 GiB address-space limit so that a mutation that makes it allocate without
bound fails the test instead of exhausting the shared machine.

Ingest: the valid base batches (tests/reliability/fuzz_messages.py) first, then ``N_MESSAGES``
mutated ones (byte-level and message-level families, seeded), 4 client threads. Every call must get
OK or a documented rejection (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION,
UNAVAILABLE) — never UNKNOWN/INTERNAL/DEADLINE_EXCEEDED — and exactly the code the daemon's own
decoder gives in this process (UNAVAILABLE allowed where it accepts). The daemon must then be alive,
accept a valid batch, have logged no traceback and counted no export failure; after SIGTERM (exit 0)
the store must hold exactly the acknowledged records, whole, with no inbox row left open
(tests/reliability/fuzz_oracle.py). Each message has its own job names (see ``numbered``: one
mutated world size would otherwise inflate every later incident of a shared job).

Found and fixed with it: a world size of any int64 (the correlator allocated range(world_size):
MemoryError), a sequence >= 2**63 (SQLite INTEGER overflow: INTERNAL), and inbox rows of incidents
the correlator replaced left open (stored again at every restart). Run with ``-s`` for the counts.

HTTP: ``N_HTTP`` generated targets (percent-encoding, unicode, ``..``, NUL, very long, unknown and
bad query parameters, real and mangled incident ids) against a daemon with stored incidents: every
response is a 2xx/4xx with a status line (no 5xx, no dropped connection), and the daemon stays up.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from gradloc.transport.wire import INGEST_METHOD, pb
from tests.reliability.fuzz_http import Requests, raw_get
from tests.reliability.fuzz_messages import Mutator, base_batches, numbered
from tests.reliability.fuzz_oracle import MAX_CULPRITS, OK, check_store, expected_codes

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
N_MESSAGES = 10_000
N_HTTP = 3_000
SEED = 11
MAX_BYTES = 256 << 10  # the daemon's --max-message-bytes: the repeat family crosses it
RETENTION_DAYS = 1e300  # retention must not delete what the oracle looks for (fuzzed times reach -1.8e308)
CLEAN = {OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


class Daemon:
    def __init__(self, tmp: Path) -> None:
        self.db, self.log, ready = tmp / "fuzz.db", tmp / "agent.log", tmp / "ready.json"
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gradloc.agent.cli", "serve", "--ingest", "127.0.0.1:0", "--http",
                 "127.0.0.1:0", "--db", str(self.db), "--ready-file", str(ready), "--straggler-deadline-s", "0.5",
                 "--max-message-bytes", str(MAX_BYTES), "--retention-days", str(RETENTION_DAYS),
                 "--retention-incidents", "100000000", "--retention-step-rows", "100000000",
                 "--max-culprits", str(MAX_CULPRITS)],
                stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=_limit_memory,
                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the daemon did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        addr = json.loads(ready.read_text())
        self.ingest = addr["ingest"]
        host, port = addr["http"].rsplit(":", 1)
        self.http = (host, int(port))
        self.channel = grpc.insecure_channel(self.ingest, options=[("grpc.max_send_message_length", 64 << 20)])
        self.call = self.channel.unary_unary(INGEST_METHOD, request_serializer=None,
                                             response_deserializer=pb.IngestReply.FromString)

    def send(self, data: bytes) -> grpc.StatusCode:
        try:
            self.call(data, timeout=30)
            return OK
        except grpc.RpcError as exc:
            return exc.code()

    def send_retrying(self, data: bytes, deadline_s: float = 60.0) -> grpc.StatusCode:
        """Like the real client: UNAVAILABLE (overloaded) means back off and send again."""
        deadline = time.monotonic() + deadline_s
        while (code := self.send(data)) == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
            time.sleep(0.5)
        return code

    def alive(self) -> bool:
        return self.proc.poll() is None and raw_get(*self.http, "/healthz")[0] == 200

    def stop(self) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise AssertionError(f"the daemon ignored SIGTERM:\n{self._tail()}") from None
        return self.proc.returncode

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_ingest_fuzz_gets_clean_codes_and_stores_whole_records(tmp_path: Path) -> None:
    t0 = time.monotonic()
    bases = base_batches()
    valid = [numbered(b, -1 - k).SerializeToString() for k, b in enumerate(bases)]
    fuzzed = Mutator(SEED, bases).messages(N_MESSAGES)
    t_gen = time.monotonic() - t0
    daemon = Daemon(tmp_path)
    try:
        assert [daemon.send_retrying(d) for d in valid] == [OK] * len(valid)  # and the daemon now knows their tables
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(daemon.send, [m.data for m in fuzzed], chunksize=16))
        t_send = time.monotonic() - t0 - t_gen
        final = numbered(bases[1], N_MESSAGES + 1).SerializeToString()
        assert daemon.alive() and daemon.send_retrying(final) == OK, daemon._tail()
        metrics = raw_get(*daemon.http, "/metrics", timeout=120.0)[1].decode()  # 10,000 jobs: a slow scrape when loaded
    finally:
        rc = daemon.stop()
    log = daemon.log.read_text(errors="replace")
    by_code = Counter(c.name for c in codes)
    by_family = Counter((m.family, c.name) for m, c in zip(fuzzed, codes))
    print(f"\n{N_MESSAGES} fuzzed messages in {t_send:.1f} s (generated in {t_gen:.1f} s): {dict(by_code)}")
    for family in dict.fromkeys(m.family for m in fuzzed):
        print(f"  {family:15s}", {c: n for (f, c), n in sorted(by_family.items()) if f == family})
    unclean = Counter((m.family, c.name) for m, c in zip(fuzzed, codes) if c not in CLEAN)
    assert not unclean, f"unclean status codes: {unclean}\n{daemon._tail()}"
    assert rc == 0, f"the daemon exited with {rc}:\n{daemon._tail()}"
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:6000]
    assert _metric(metrics, "gradloc_export_failures_total") == 0, metrics
    # every rejection counted by reason, but those grpc refused before the daemon saw them (over its limit)
    grpc_limit = 2 * MAX_BYTES + (1 << 20)
    refused = sum(1 for m, c in zip(fuzzed, codes) if c not in (OK, grpc.StatusCode.UNAVAILABLE)
                  and len(m.data) <= grpc_limit)
    overloaded = _metric(metrics, 'gradloc_agent_rejected_total{reason="overloaded"}')
    assert _metric(metrics, "gradloc_agent_rejected_total") - overloaded == refused
    assert overloaded >= by_code.get("UNAVAILABLE", 0)

    want = expected_codes(bases, [m.data for m in fuzzed], MAX_BYTES)
    wrong = [(i, m.family, c.name, w.name) for i, (m, c, (w, _)) in enumerate(zip(fuzzed, codes, want))
             if c != w and not (c == grpc.StatusCode.UNAVAILABLE and w == OK)]
    assert not wrong, f"{len(wrong)} answers differ from the decoder's: {wrong[:10]}"
    acked = [b for (c, (_, b)) in zip(codes, want) if c == OK]
    unavailable = [b for (c, (_, b)) in zip(codes, want) if c == grpc.StatusCode.UNAVAILABLE]
    final_batch = expected_codes(bases, [final], MAX_BYTES)[0][1]
    valid_batches = [b for _, b in expected_codes(bases, valid, MAX_BYTES)]
    cutoff = time.time() - RETENTION_DAYS * 86_400
    counts = check_store(daemon.db, [*valid_batches, *acked, final_batch], unavailable, cutoff)
    assert counts["step_rows"] > 0 and counts["unambiguous_incidents"] > 1_000, counts
    print(f"  store: {counts}; total {time.monotonic() - t0:.1f} s")


def test_http_api_fuzz_answers_2xx_or_4xx(tmp_path: Path) -> None:
    t0 = time.monotonic()
    bases = base_batches()
    daemon = Daemon(tmp_path)
    try:
        for k, b in enumerate(bases * 3):
            assert daemon.send(numbered(b, k).SerializeToString()) == OK
        ids: list[str] = []
        deadline = time.monotonic() + 30
        while len(ids) < 5 and time.monotonic() < deadline:  # incidents close after the straggler deadline
            time.sleep(0.2)
            ids = [row["incident_id"] for row in json.loads(raw_get(*daemon.http, "/api/incidents?limit=100")[1])]
        assert len(ids) >= 5, ids
        targets = Requests(SEED, ids).targets(N_HTTP)
        accepts = (None, "application/openmetrics-text; version=1.0.0", "*/*;q=abc", "text/plain;;;", "🙂", "")
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda t: raw_get(*daemon.http, t[1], accept=accepts[t[0] % len(accepts)])[0],
                                    enumerate(targets)))
        assert daemon.alive()
    finally:
        rc = daemon.stop()
    by_status = Counter(answers)
    print(f"\n{N_HTTP} HTTP targets in {time.monotonic() - t0:.1f} s: {dict(sorted(by_status.items()))}")
    bad = [(s, t[:100]) for s, t in zip(answers, targets) if not (200 <= s < 300 or 400 <= s < 500)]
    assert not bad, f"{len(bad)} answers outside 2xx/4xx, e.g. {bad[:10]}\n{daemon._tail()}"
    assert by_status[200] > N_HTTP // 10 and by_status[400] > 0 and by_status[404] > 0, by_status
    assert rc == 0 and "Traceback" not in daemon.log.read_text(errors="replace"), daemon._tail()
