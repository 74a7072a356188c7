"""Start this checkout's ``gradloc-agent serve`` on a fixed port (the reliability tests restart it there).

The console script would run whatever gradloc the venv has installed; ``python -m gradloc.agent.cli``
with this checkout on PYTHONPATH runs the code under test.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start_daemon(db: Path | str, port: int, tmp: Path, i: int, *flags: str) -> subprocess.Popen[bytes]:
    """Start daemon number ``i`` on the store ``db`` (a SQLite file or a postgresql:// URL; its log:
    ``tmp/agent-<i>.log``) and wait until it is ready."""
    ready = tmp / f"ready-{i}.json"
    log = open(tmp / f"agent-{i}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "gradloc.agent.cli", "serve", "--ingest", f"127.0.0.1:{port}",
                             "--http", "127.0.0.1:0", "--store", str(db), "--ready-file", str(ready),
                             "--straggler-deadline-s", "0.5", *flags],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"daemon {i} did not start:\n{(tmp / f'agent-{i}.log').read_text()}")
        time.sleep(0.02)
    return proc


def metrics_text(tmp: Path, i: int) -> str:
    """Daemon ``i``'s /metrics (its HTTP address is in its ready file)."""
    import json
    import urllib.request

    http = json.loads((tmp / f"ready-{i}.json").read_text())["http"]
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as resp:
        return resp.read().decode()


@contextmanager
def serving(tmp: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """This checkout's daemon with ``flags`` (no store unless given, debug log); yields its ready-file
    addresses plus "log" (the log file), and requires a clean exit on SIGTERM."""
    ready, log = tmp / "ready.json", tmp / "agent.log"
    ready.unlink(missing_ok=True)
    store = () if "--db" in flags else ("--db", "none")
    cmd = [sys.executable, "-m", "gradloc.agent.cli", "serve", *store, "--ready-file", str(ready),
           "--log-level", "debug", *flags]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield {**json.loads(ready.read_text()), "log": str(log)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()
