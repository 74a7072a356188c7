"""A PostgreSQL store that goes away while a daemon writes it: the daemon stays up, counts what failed,
refuses the batches it cannot commit with UNAVAILABLE (the client keeps them and resends after its
backoff, instead of dropping them as it drops an INTERNAL), and once the database is back every
incident the client offered is stored (those acknowledged but not yet stored when the outage hit, after
the daemon's next start, from its inbox).

The outage is real, on the tier's server: the test database stops accepting connections and its open
sessions are ended (``ALLOW_CONNECTIONS false`` and ``pg_terminate_backend``), as a failover or a
server restart does.
"""
from __future__ import annotations

import re
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gradloc.demo.spawn import free_port
from gradloc.store import IncidentStore
from gradloc.transport import AgentClient
from tests.builders import incident_record
from tests.reliability.daemon import metrics_text, start_daemon

pytestmark = [pytest.mark.integration, pytest.mark.postgres]


def _offer(client: AgentClient, first: int, n: int) -> list[str]:
    ids = []
    for k in range(first, first + n):
        iid = f"{k:032x}"
        client.on_incident(replace(incident_record(k), incident_id=iid, job="outage", rank=0, time_unix=time.time()))
        ids.append(iid)
    return ids


def _stored(url: str) -> set[str]:
    with IncidentStore(url, create=False) as store:
        return {f.incident_id for inc in store.iter_incidents() for f in inc.findings}


def _counter(text: str, name: str, label: str) -> float:
    found = re.search(rf"^{name}\{{[^}}]*{label}[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def test_a_database_outage_loses_no_incident_and_the_daemon_stays_up(pg_server, tmp_path: Path) -> None:
    name = pg_server.database()
    url, port = pg_server.url(name), free_port()
    proc = start_daemon(url, port, tmp_path, 0)
    client = AgentClient(f"127.0.0.1:{port}", job="outage", rank=0, world_size=1, backoff_initial_s=0.05,
                         backoff_max_s=0.3, timeout_s=5.0, flush_interval_s=0.02)
    try:
        offered = _offer(client, 0, 20)
        client.force_flush(timeout_s=30)
        pg_server.admin(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        pg_server.admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
        offered += _offer(client, 20, 20)  # sent while no connection can be made
        time.sleep(2.0)
        assert proc.poll() is None, "the daemon exited during the outage"
        metrics = metrics_text(tmp_path, 0)
        assert _counter(metrics, "gradloc_agent_rejected_total", 'reason="overloaded"') > 0, metrics[-3000:]
        pg_server.admin(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
        offered += _offer(client, 40, 20)
        assert client.force_flush(timeout_s=60), client.counters
        assert client.counters["send_failed"] == 0 and client.counters["rejected"] == 0, client.counters
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    proc = start_daemon(url, port, tmp_path, 1)  # the next start stores what the outage left in the inbox
    try:
        deadline = time.monotonic() + 60
        while not set(offered) <= _stored(url) and time.monotonic() < deadline:
            time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        client.shutdown(timeout_s=5)
    assert set(offered) <= _stored(url), sorted(set(offered) - _stored(url))[:5]
    pg_server.admin(f"DROP DATABASE {name} WITH (FORCE)")
