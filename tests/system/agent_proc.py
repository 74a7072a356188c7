"""Run the real ``gradloc-agent`` CLI as a subprocess (daemon or demo) for the integration tests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

AGENT = str(Path(sys.executable).with_name("gradloc-agent"))


@dataclass
class DaemonHandle:
    process: subprocess.Popen[bytes]
    ingest: str
    http: str
    db: Path
    log: Path

    def get(self, path: str, accept: str | None = None) -> tuple[bytes, str]:
        req = urllib.request.Request(f"http://{self.http}{path}", headers={"Accept": accept} if accept else {})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read(), resp.headers.get("Content-Type", "")

    def json(self, path: str) -> Any:
        return json.loads(self.get(path)[0])


@contextmanager
def running_daemon(tmp: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[DaemonHandle]:
    """Start ``gradloc-agent serve`` on free ports; on exit SIGTERM it and require a clean exit (0).

    Records built by tests/builders.py carry fixed 2023 timestamps: under the default 30-day retention the
    daemon's first retention sweep would delete them whenever it ran after they arrived (it runs once the daemon
    is idle: a race with the scheduler). So retention keeps 100 years unless a test asks for its own."""
    if "--retention-days" not in flags:
        flags = (*flags, "--retention-days", "36500")
    ready, log = tmp / "ready.json", tmp / "agent.log"
    db = tmp / "agent.db"
    cmd = [AGENT, "serve", "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", str(db),
           "--ready-file", str(ready), *flags]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"gradloc-agent did not start (rc={proc.poll()}):\n{log.read_text()}")
            time.sleep(0.05)
        addr = json.loads(ready.read_text())
        yield DaemonHandle(proc, addr["ingest"], addr["http"], db, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)  # the daemon dumps its threads' stacks into the log
                time.sleep(2)
                proc.kill()
                raise AssertionError(f"gradloc-agent ignored SIGTERM:\n{log.read_text()}") from None
    assert proc.returncode == 0, f"gradloc-agent exited with {proc.returncode}:\n{log.read_text()}"


def run_demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``gradloc-agent demo`` in its own process (the trainer) and require success."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([AGENT, "demo", *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, f"demo failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res
