"""The monitor's counters reach /metrics: ``gradloc_monitor_events_total{job, rank, event}``, in embedded mode
(the StepRecord itself) and through the daemon's path (a decoded step), undeclared names as ``event="other"``."""
from __future__ import annotations

import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families as parse_text

import gradloc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gradloc.agent.core import AgentCore  # noqa: E402
from gradloc.agent.embedded import EmbeddedAgent  # noqa: E402
from gradloc.exporters.prometheus import render  # noqa: E402
from gradloc.transport.codec import BatchDecoder  # noqa: E402
from tests.builders import step_record  # noqa: E402
from tests.helpers import (  # noqa: E402
    backward_step,
    make_data,
    single_thread,  # noqa: E402,F401 (autouse fixture)
    tiny_gpt,
)
from tests.transport.factories import to_bytes  # noqa: E402

NAME = "gradloc_monitor_events_total"


def events_in(text: str) -> dict[tuple[str, str, str], float]:
    return {(s.labels["job"], s.labels["rank"], s.labels["event"]): s.value
            for fam in parse_text(text) for s in fam.samples if s.name == NAME}


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def _broken_probe(i: int, mask: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the user's probe closure broke")


def test_a_failed_localization_and_an_undeclared_counter_reach_the_embedded_metrics(tmp_path: Path) -> None:
    model = tiny_gpt(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(10, 1)
    data.plant(7, 0, 1, 3)
    mon = gradloc.watch(model, opt, detector=gradloc.DetectorConfig(warmup=5), job="ev",
                        store_path=str(tmp_path / "ev.db"), metrics_address="127.0.0.1:0")
    (agent,) = [s for s in mon.sinks if isinstance(s, EmbeddedAgent)]
    try:
        for s in range(10):
            total = backward_step(model, data, s, mon)
            rep = mon.end_step(total, probe=_broken_probe)
            if s == 7:  # the planted spike: its localization failed (the probe raised), training went on
                assert rep.incident is not None and rep.incident.localization.status == "unavailable"
                mon.counters["my_integration_errors"] += 2  # a counter gradloc/records/events.py does not declare
            opt.step()
            opt.zero_grad()
        assert mon.counters["localize_errors"] == 1
        agent.force_flush()
        events = events_in(_scrape(agent.metrics_url))
        # the record of step 8 (emitted when step 9 ended) carried the cumulative counts
        assert events == {("ev", "0", "localize_errors"): 1.0, ("ev", "0", "other"): 2.0}
        assert mon.history[-1].events == (("localize_errors", 1), ("my_integration_errors", 2))
        assert mon.history[0].events == ()  # nothing was counted before the spike
    finally:
        mon.close()


def test_decoded_steps_carry_their_events_into_the_state() -> None:
    """The daemon's path: the wire's events of each step (cumulative), invalid entries dropped and counted."""
    batch = BatchDecoder().decode(to_bytes([
        step_record(0, events=(("hook_errors", 3), ("sink_errors", 1))),
        step_record(1, events=(("hook_errors", 5), ("sink_errors", 1), ("zz_new_in_a_later_version", 7))),
    ]))
    assert batch.steps[1].events == (("hook_errors", 5), ("sink_errors", 1), ("zz_new_in_a_later_version", 7))
    bad = BatchDecoder().decode(to_bytes([step_record(2, events=(("x" * 65, 1), ("left_job", -1), ("left_job_", 1)))]))
    assert bad.steps[0].events == (("left_job_", 1),) and bad.steps[0].events_dropped == 2
    core = AgentCore().start()
    try:
        assert core.submit([*batch.steps, replace(bad.steps[0], job="other-job")])
        assert core.flush(10.0)
        text = render(core.state, None)[0].decode()
    finally:
        core.close()
    assert events_in(text) == {("job-a", "1", "hook_errors"): 5.0, ("job-a", "1", "sink_errors"): 1.0,
                               ("job-a", "1", "other"): 7.0, ("other-job", "1", "other"): 1.0}
    assert 'gradloc_agent_series_dropped_total{reason="monitor_events"} 2.0' in text


def test_invalid_data_groups_are_dropped_and_counted_the_step_kept() -> None:
    """A step's groups from the wire: an unknown kind, an empty name or a negative count is dropped (not the step)
    and counted (``series_dropped{reason="data_groups"}``)."""
    from gradloc.transport._generated.gradloc.v1 import gradloc_pb2 as pb
    from gradloc.transport.codec_lists import groups_of as _groups

    m = pb.Step(groups=[pb.GroupTokensMsg(kind="source", name="web", samples=2, tokens=100),
                        pb.GroupTokensMsg(kind="position", name="≤16", samples=1, tokens=1),
                        pb.GroupTokensMsg(kind="source", name="", samples=1, tokens=1),
                        pb.GroupTokensMsg(kind="tag", name="lang=py", samples=-1, tokens=1)])
    kept, dropped = _groups(m)
    assert [(str(g.kind), g.name, g.samples, g.tokens) for g in kept] == [("source", "web", 2, 100)] and dropped == 3
    step = replace(step_record(3), groups=())
    core = AgentCore().start()
    try:
        from gradloc.reports import summarize
        assert core.submit([replace(summarize(step), groups=kept, groups_dropped=dropped)])
        assert core.flush(10.0)
        text = render(core.state, None)[0].decode()
    finally:
        core.close()
    assert 'gradloc_agent_series_dropped_total{reason="data_groups"} 3.0' in text


def test_invalid_precursor_stats_are_dropped_and_counted_the_step_kept() -> None:
    """A step's precursor statistics from the wire (the daemon's path, real bytes): an unknown kind, a non-finite
    value, a negative head or a location that is not three counts is dropped (not the step) and counted
    (``series_dropped{reason="precursors"}``); the valid ones become gauges."""
    from gradloc.transport._generated.gradloc.v1 import gradloc_pb2 as pb
    from gradloc.transport.codec_lists import precursors_of

    m = pb.Step(precursors=[pb.PrecursorMsg(kind="attn_max_logit", layer="blocks.0", value=7.5, at=[0, 1, 2]),
                            pb.PrecursorMsg(kind="attn_wobble", layer="blocks.0", value=1.0),
                            pb.PrecursorMsg(kind="attn_entropy", layer="blocks.0", value=float("nan")),
                            pb.PrecursorMsg(kind="attn_entropy", layer="blocks.0", value=1.0, head=-1),
                            pb.PrecursorMsg(kind="residual_rms", layer="norm", value=1.0, at=[0, 1])])
    kept, dropped = precursors_of(m)
    assert [(str(p.kind), p.layer, p.value, p.at) for p in kept] == [("attn_max_logit", "blocks.0", 7.5, (0, 1, 2))]
    assert dropped == 4
    from tests.builders import precursor_stats

    batch = BatchDecoder().decode(to_bytes([step_record(4, precursors=precursor_stats())]))
    assert batch.steps[0].precursors == precursor_stats()  # every kind, heads and experts, through the wire
    core = AgentCore().start()
    try:
        assert core.submit([replace(batch.steps[0], precursors=kept, precursors_dropped=dropped)])
        assert core.flush(10.0)
        text = render(core.state, None)[0].decode()
    finally:
        core.close()
    assert 'gradloc_agent_series_dropped_total{reason="precursors"} 4.0' in text
    assert 'gradloc_attention_max_logit{job="job-a",layer="blocks.0",rank="1"} 7.5' in text
