"""The daemon enforces its per-job incident limits and counts them on /metrics (a real daemon)."""
from __future__ import annotations

import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from gradloc.transport import AgentClient
from tests.builders import incident_record
from tests.reliability.daemon import serving

pytestmark = pytest.mark.integration


def test_incident_rate_and_culprit_limits(tmp_path: Path) -> None:
    with serving(tmp_path, "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0", "--max-incidents-per-minute", "2",
                "--max-culprits", "1") as agent:
        client = AgentClient(agent["ingest"], job="lim", rank=1, world_size=4, timeout_s=5.0)
        for n in range(5):
            inc = incident_record(n)
            loc = inc.localization
            client.on_incident(replace(inc, job="lim", time_unix=time.time(),
                                       localization=replace(loc, culprits=loc.culprits * 2)))
        client.shutdown(timeout_s=20)
        metrics = urllib.request.urlopen(f"http://{agent['http']}/metrics", timeout=10).read().decode()
    assert client.counters["sent_incidents"] == 5  # acknowledged: the client does not retry them
    assert 'gradloc_agent_limited_total{limit="incident_rate"} 3.0' in metrics
    assert 'gradloc_agent_limited_total{limit="culprits"} 2.0' in metrics
