"""A real Prometheus server for tests: start it on a free port, scrape targets, query the HTTP API.

Why a real server and not a parser: it checks what users depend on — that Prometheus 2.42 accepts
the exposition (OpenMetrics with exemplars included), what label names survive target labelling,
and that PromQL over the scraped series gives the numbers dashboards will show.

    with running_prometheus(["127.0.0.1:8000"]) as prom:
        prom.wait_for('gradloc_steps_total', lambda r: len(r) == 3)

The binary is not optional: when it is missing the test FAILS and says to run scripts/setup.sh
(a skipped test would hide that the exporter was never checked against Prometheus).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gradloc.demo.spawn import free_port

PROMETHEUS = os.environ.get("GRADLOC_PROMETHEUS", "/usr/bin/prometheus")
READY_TIMEOUT_S = 30.0

Result = list[dict[str, Any]]


def require_binary(path: str = PROMETHEUS) -> str:
    """The Prometheus binary, or a test failure that says how to install it."""
    found = path if os.access(path, os.X_OK) else shutil.which("prometheus")
    if not found:
        pytest.fail(f"Prometheus binary not found at {path} (nor on PATH): run scripts/setup.sh "
                    "(installs Debian's prometheus 2.42) or set GRADLOC_PROMETHEUS", pytrace=False)
    return found


def write_config(path: Path, targets: Sequence[str], scrape_interval: str, honor_labels: bool) -> None:
    """One scrape job over ``targets``.

    ``honor_labels: true`` keeps gradloc's own ``job`` label; without it Prometheus renames it to
    ``exported_job`` and sets ``job`` to the scrape job's name.
    """
    cfg = {
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                   "evaluation_interval": scrape_interval},
        "scrape_configs": [{"job_name": "gradloc", "honor_labels": honor_labels,
                            "static_configs": [{"targets": list(targets)}]}],
    }
    path.write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML


@dataclass
class PromHandle:
    """A running Prometheus: its base URL and HTTP API helpers."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    workdir: Path
    poll_s: float = field(default=0.2)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"

    def api(self, path: str, **params: Any) -> Any:
        """GET ``/api/v1/<path>``; returns ``data`` or raises with Prometheus' error text."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"GET {url}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from exc
        if body.get("status") != "success":
            raise AssertionError(f"GET {url}: {body}")
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> Result:
        """Instant query; a scalar/string result comes back as one row with empty labels."""
        data = self.api("query", query=promql, time=at)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def wait_for(self, promql: str, predicate: Callable[[Result], bool] = bool, timeout: float = 15.0) -> Result:
        """Poll ``promql`` until ``predicate(result)`` holds; on timeout fail with the last result
        and the targets' scrape errors (the usual reason nothing shows up)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{promql!r} did not satisfy the predicate within {timeout}s; "
                                     f"last result {result}; targets {self._target_health()}")
            time.sleep(self.poll_s)

    def exemplars(self, promql: str, start: float, end: float) -> Result:
        """``/api/v1/query_exemplars``: [{"seriesLabels": {...}, "exemplars": [{labels, value, timestamp}]}]."""
        return self.api("query_exemplars", query=promql, start=start, end=end)

    def targets(self) -> Result:
        """The active targets (``health``, ``lastError``, ``labels``, ``scrapeUrl``...)."""
        return self.api("targets")["activeTargets"]

    def _target_health(self) -> list[tuple[str, str, str]]:
        try:
            return [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.targets()]
        except Exception as exc:  # noqa: BLE001 - only decorates another failure
            return [("?", "?", repr(exc))]


def _wait_ready(handle: PromHandle) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {handle.process.returncode} before becoming ready")
        try:
            with urllib.request.urlopen(f"{handle.url}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"prometheus not ready after {READY_TIMEOUT_S}s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _start(binary: str, workdir: Path, config: Path, extra_flags: Sequence[str]) -> PromHandle:
    port = free_port()
    log_path = workdir / "prometheus.log"
    cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage", *extra_flags]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=workdir)
    return PromHandle(f"http://127.0.0.1:{port}", process, log_path, workdir)


def _report(handle: PromHandle | None, exc: BaseException) -> None:
    """Attach Prometheus' log to a failure (pytest prints exception notes and captured stderr)."""
    if handle is None:
        return
    log = handle.log()
    tail = log[-8000:]
    exc.add_note(f"--- prometheus log ({handle.url}, last {len(tail)} chars) ---\n{tail}")
    print(f"--- prometheus log ({handle.url}) ---\n{log}", file=sys.stderr)


@contextlib.contextmanager
def running_prometheus(targets: list[str], scrape_interval: str = "1s", extra_flags: Sequence[str] = (),
                       honor_labels: bool = True) -> Iterator[PromHandle]:
    """Start Prometheus scraping ``targets`` ("host:port", path /metrics), yield a handle, stop it.

    The process is always terminated; on any failure inside the block (or at start-up) its log is
    attached to the exception. A start that loses the free-port race is retried once.
    """
    binary = require_binary()
    with tempfile.TemporaryDirectory(prefix="gradloc-prom-") as tmp:
        workdir = Path(tmp)
        config = workdir / "prometheus.yml"
        write_config(config, targets, scrape_interval, honor_labels)
        handle: PromHandle | None = None
        try:
            for attempt in (1, 2):
                handle = _start(binary, workdir, config, extra_flags)
                try:
                    _wait_ready(handle)
                    break
                except RuntimeError:
                    _stop(handle.process)
                    if attempt == 2 or "address already in use" not in handle.log():
                        raise
            assert handle is not None
            yield handle
        except BaseException as exc:
            _report(handle, exc)
            raise
        finally:
            if handle is not None:
                _stop(handle.process)
