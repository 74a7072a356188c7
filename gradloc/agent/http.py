"""The agent's HTTP side: ``/metrics``, ``/healthz``, ``/api/incidents`` and ``/api/incidents/<id>``.

A standard-library threading HTTP server (one thread per request, so a slow scrape never holds up
the API). Binds 127.0.0.1 unless told otherwise: incidents carry training text.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from gradloc.agent.core import AgentCore
from gradloc.errors import GradlocError
from gradloc.exporters.prometheus import make_registry, render
from gradloc.records import to_dict
from gradloc.store.incident_json import correlated_to_dict
from gradloc.store.rows import IncidentRow

log = logging.getLogger(__name__)


def parse_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``host:port`` or ``:port`` or ``port`` → (host, port); port 0 picks a free one."""
    host, sep, port = address.rpartition(":")
    if not sep:
        host, port = "", address
    try:
        number = int(port)
    except ValueError as exc:
        raise ValueError(f"bad address {address!r}: expected host:port") from exc
    if not 0 <= number <= 65535:
        raise ValueError(f"bad address {address!r}: port out of range")
    return (host.strip("[]") or default_host), number


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, not stderr
        log.debug("http %s", fmt % args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        try:
            if url.path == "/metrics":
                body, ctype = render(self.server.registry, self.headers.get("Accept"))
                return self._send(200, body, ctype)
            if url.path == "/healthz":
                return self._json(200, self.server.health())
            if url.path.rstrip("/") == "/api/incidents":
                return self._json(200, self.server.list_incidents(parse_qs(url.query)))
            if url.path.startswith("/api/incidents/"):
                inc = self.server.get_incident(url.path.rsplit("/", 1)[1])
                return self._json(200, inc) if inc is not None else self._json(404, {"error": "no such incident"})
            self._json(404, {"error": f"no route {url.path}"})
        except (ValueError, GradlocError) as exc:  # bad query, ambiguous id prefix
            self._json(400, {"error": str(exc)})
        except Exception:  # noqa: BLE001 - a request never takes the server down
            log.exception("gradloc agent: %s failed", url.path)
            self._json(500, {"error": "internal error (see the agent's log)"})

    def _json(self, code: int, payload: Any) -> None:
        self._send(code, json.dumps(payload, ensure_ascii=False).encode(), "application/json; charset=utf-8")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], core: AgentCore) -> None:
        super().__init__(address, _Handler)
        self.core, self.registry, self.started = core, make_registry(core.state), time.time()

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "uptime_s": round(time.time() - self.started, 3),
                "pending_incidents": self.core.correlator.pending, "queued": self.core.queued,
                "jobs": self.core.activity.jobs, "ranks": self.core.activity.ranks,
                "store": self.core.store is not None}

    def list_incidents(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        job = query.get("job", [None])[-1]
        limit = _int(query, "limit", 50)
        since = _float(query, "since", None)
        if self.core.store is not None:
            rows = self.core.store.list_incidents(job=job, limit=limit, since_unix=since)
            return [to_dict(r) for r in rows]
        recent = [i for i in reversed(self.core.recent)
                  if (job is None or i.job == job) and (since is None or i.time_unix >= since)]
        return [to_dict(IncidentRow.of(i)) for i in recent[:limit]]

    def get_incident(self, incident_id: str) -> dict[str, Any] | None:
        if self.core.store is not None:
            inc = self.core.store.get_incident(incident_id)
        else:
            inc = next((i for i in self.core.recent if i.incident_id.startswith(incident_id)), None)
        return None if inc is None else correlated_to_dict(inc)


def _int(query: dict[str, list[str]], key: str, default: int) -> int:
    try:
        value = int(query.get(key, [default])[-1])
    except ValueError as exc:
        raise ValueError(f"{key} must be an integer") from exc
    if not 1 <= value <= 10_000:
        raise ValueError(f"{key} must be in 1..10000")
    return value


def _float(query: dict[str, list[str]], key: str, default: float | None) -> float | None:
    try:
        return float(query[key][-1]) if key in query else default
    except ValueError as exc:
        raise ValueError(f"{key} must be a number (unix time)") from exc


class AgentHttpServer:
    """Owns the server thread; ``address`` is the bound (host, port)."""

    def __init__(self, core: AgentCore, address: str = "127.0.0.1:0") -> None:
        self._server = _Server(parse_address(address), core)
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._server.serve_forever, name="gradloc-agent-http",
                                        kwargs={"poll_interval": 0.2}, daemon=True)

    def start(self) -> "AgentHttpServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
