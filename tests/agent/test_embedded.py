"""Embedded mode: ``watch(...)`` without an agent runs the store and exporters in the training process."""
from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import torch

import gradloc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gradloc.agent.embedded import EmbeddedAgent  # noqa: E402
from gradloc.store.sqlite import IncidentStore  # noqa: E402
from tests.helpers import (  # noqa: E402
    make_data,
    single_thread,  # noqa: E402,F401 (autouse fixture)
    tiny_gpt,
    train,
)

DET = gradloc.DetectorConfig(warmup=5)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read()


def test_embedded_agent_serves_metrics_and_stores_the_incident(tmp_path: Path) -> None:
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(9, 2)
    planted = data.plant(8, 1, 2, 5)
    db = tmp_path / "emb.db"
    mon = gradloc.watch(model, opt, detector=DET, job="emb", store_path=str(db), metrics_address="127.0.0.1:0")
    (agent,) = [s for s in mon.sinks if isinstance(s, EmbeddedAgent)]
    reports = train(model, opt, data, mon)
    assert reports[-1].incident is not None
    agent.force_flush()
    metrics = _get(agent.metrics_url).decode()
    assert 'gradloc_steps_total{job="emb",rank="0"} 8.0' in metrics  # the 9th arrives with close()
    assert 'gradloc_grad_norm{job="emb",layer="head",rank="0"}' in metrics
    base = agent.metrics_url.rsplit("/", 1)[0]
    mon.close()  # emits the last step record: the incident of step 8 closes, complete
    with IncidentStore(db) as store:
        rows = store.list_incidents(job="emb")
        assert [r.step for r in rows] == [8] and rows[0].status == "complete"
        inc = store.get_incident(rows[0].incident_id)
        assert (inc.spans[0].span.micro_batch, inc.spans[0].span.sample, inc.spans[0].span.start) == planted
        assert len(store.step_summaries("emb")) == 9
    assert agent.http is None  # the server went down with the monitor
    try:
        _get(base + "/healthz")
        raise AssertionError("the embedded HTTP server still answers after close()")
    except OSError:
        pass


def test_embedded_api_answers_while_training(tmp_path: Path) -> None:
    model = tiny_gpt(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(10, 1)
    data.plant(7, 0, 1, 3)
    mon = gradloc.watch(model, opt, detector=DET, job="api", store_path=str(tmp_path / "a.db"),
                        metrics_address="127.0.0.1:0")
    (agent,) = [s for s in mon.sinks if isinstance(s, EmbeddedAgent)]
    train(model, opt, data, mon)
    agent.force_flush()
    base = agent.metrics_url.rsplit("/", 1)[0]
    listed = json.loads(_get(base + "/api/incidents?job=api"))
    assert [i["step"] for i in listed] == [7]
    full = json.loads(_get(base + f"/api/incidents/{listed[0]['incident_id'][:10]}"))
    assert full["job"] == "api" and len(full["trace_id"]) == 32 and full["findings"][0]["step"] == 7
    assert json.loads(_get(base + "/healthz"))["status"] == "ok"
    mon.close()


def test_no_store_and_no_embedded_agent_when_disabled(tmp_path: Path) -> None:
    model = tiny_gpt(2)
    mon = gradloc.watch(model, embedded=False)
    assert not any(isinstance(s, EmbeddedAgent) for s in mon.sinks)
    mon.close()


def test_a_busy_metrics_port_is_a_clear_attach_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        try:
            gradloc.watch(tiny_gpt(3), store_path=str(tmp_path / "b.db"), metrics_address=f"127.0.0.1:{port}")
            raise AssertionError("watch() attached although the metrics port is taken")
        except gradloc.AttachError as exc:
            assert f"cannot serve /metrics on 127.0.0.1:{port}" in str(exc)
