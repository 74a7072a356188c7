"""A one-step spike between two scrapes reaches a real Prometheus 2.42 through the overview panel's query.

This checkout's daemon receives step records over gRPC with the trainer's codec; a real Prometheus scrapes its
/metrics every second. Steps faster than the scrapes (batches of 5 steps, one norm and loss spike inside a batch,
never its last step): the overview panels' queries (gradloc_grad_global_norm_max, gradloc_loss_max, as the
dashboard defines them) return the spike's values. Then scrapes faster than steps (one step every 3 s): every
scraped maximum is a step's value, never 0, and the scrapes with no new step repeat the last one.
"""
from __future__ import annotations

import time
from pathlib import Path

import grpc

from tests.builders import step_record
from tests.grafana.promql import queries
from tests.reliability.daemon import serving
from tests.system.prom import running_prometheus
from tests.transport.factories import client_info, encode

JOB = "win"
SPIKE_NORM, SPIKE_LOSS = 50.0, 9.0


def _panel_query(title_start: str) -> str:
    """The first target of the overview panel whose title starts so (Grafana's variables as "All")."""
    return next(expr for uid, title, expr in queries() if uid == "gradloc-overview" and title.startswith(title_start))


class _Sender:
    def __init__(self, ingest: str) -> None:
        self._channel = grpc.insecure_channel(ingest)
        self._call = self._channel.unary_unary("/gradloc.v1.IngestService/Ingest")
        self._sequence = 0
        self.step = 0

    def send(self, norms_losses: list[tuple[float, float]]) -> None:
        steps = []
        for norm, loss in norms_losses:
            steps.append(step_record(self.step, job=JOB, rank=0, time_unix=time.time(), global_norm=norm, loss=loss))
            self.step += 1
        msg, _ = encode(steps, [], client=client_info(job=JOB, rank=0, world_size=1, client_id="window-max"))
        self._sequence += 1
        msg.sequence = self._sequence  # a repeated sequence would be taken for a re-send and dropped
        self._call(msg.SerializeToString(), timeout=30)

    def close(self) -> None:
        self._channel.close()


def _raw(prom, metric: str, since: float) -> list[float]:
    """Every sample Prometheus stored for ``metric`` of the job since ``since`` (a range selector: no lookback fill)."""
    secs = max(1, int(time.time() - since) + 1)
    rows = prom.query(f'{metric}{{job="{JOB}"}}[{secs}s]')
    return [float(v) for row in rows for _, v in row["values"]]


def test_a_one_step_spike_between_scrapes_shows_on_the_overview_panels(tmp_path: Path) -> None:
    norm_q, loss_q = _panel_query("Global gradient norm"), _panel_query("Loss")
    assert "gradloc_grad_global_norm_max" in norm_q and "gradloc_loss_max" in loss_q, (norm_q, loss_q)
    with serving(tmp_path, "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0") as agent:
        with running_prometheus([agent["http"]], scrape_interval="1s") as prom:
            sender = _Sender(agent["ingest"])
            try:
                start = time.time()
                # steps faster than scrapes: 8 batches of 5 steps ~0.25 s apart (~20 steps/s); the spike is
                # the 3rd step of the 5th batch, so no batch ends on it
                for b in range(8):
                    batch = [(1.0 + 0.01 * i, 2.0) for i in range(5)]
                    if b == 4:
                        batch[2] = (SPIKE_NORM, SPIKE_LOSS)
                    sender.send(batch)
                    time.sleep(0.25)
                last = sender.step - 1
                prom.wait_for(f'gradloc_step{{job="{JOB}"}} == {last}', timeout=30)
                time.sleep(2.5)  # a few more scrapes with no new step
                end = time.time()

                def panel_max(expr: str) -> float:
                    res = prom.api("query_range", query=expr, start=start, end=end, step=0.5)["result"]
                    series = [r for r in res if r["metric"].get("job") == JOB]
                    assert series, (expr, res)
                    return max(float(v) for r in series for _, v in r["values"])

                assert panel_max(norm_q) == SPIKE_NORM
                assert panel_max(loss_q) == SPIKE_LOSS
                latest = _raw(prom, "gradloc_grad_global_norm", start)
                print(f"latest-step gauge: {len(latest)} scrapes, spike seen: {SPIKE_NORM in latest}; "
                      f"window max: {sorted(set(_raw(prom, 'gradloc_grad_global_norm_max', start)))}")

                # scrapes faster than steps: one step every 3 s, 3 scrapes or so per step
                slow_start = time.time()
                slow = [(2.0, 2.2), (3.0, 2.1), (2.5, 2.0)]
                for norm, loss in slow:
                    sender.send([(norm, loss)])
                    time.sleep(3.0)
                prom.wait_for(f'gradloc_step{{job="{JOB}"}} == {sender.step - 1}', timeout=30)
                time.sleep(1.5)
                values = _raw(prom, "gradloc_grad_global_norm_max", slow_start)
            finally:
                sender.close()
    before = 1.0 + 0.01 * 4  # the last fast step's norm: what the scrapes before the first slow step's show
    while values and values[0] == before:
        values.pop(0)
    assert len(values) >= 5, values  # more scrapes than steps
    assert set(values) <= {norm for norm, _ in slow}, values  # never 0, never the previous window's spike
    repeats = sum(a == b for a, b in zip(values, values[1:]))
    assert repeats >= 2, values  # scrapes without a new step repeat the latest value
