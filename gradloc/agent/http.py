"""The agent's HTTP side: ``/metrics``, ``/healthz``, ``/api/incidents`` and ``/api/incidents/<id>``, the findings
(``/api/outliers``, ``/api/precursors``: gradloc/agent/api_rows.py), and the incident pages ``/incidents`` and
``/incidents/<id>`` (HTML, gradloc/agent/incident_page.py);
``/incidents/trace/<trace id>`` redirects to the page of the incident with that trace id (the
Grafana datasource's exemplar link: exemplars carry trace ids).

With an auth token, a request needs the bearer header, except ``/healthz``, ``/metrics`` with
``metrics_open``, and an incident page (or its trace redirect) opened by a signed link
(``?sig=``, gradloc/agent/links.py): that link opens that page and nothing else. A scrape that sent
the token gets exemplars with a ``sig``; ``/api/incidents`` rows carry a ``link``.

A standard-library threading HTTP server (one thread per request, so a slow scrape never holds up
the API). Binds 127.0.0.1 unless told otherwise: incidents carry training text.
"""
from __future__ import annotations

import logging
import re
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable
from urllib.parse import parse_qs, urlsplit

from gradloc.agent import api_rows, links, patterns
from gradloc.agent.core import AgentCore
from gradloc.agent.escape import json_text
from gradloc.agent.incident_page import incident_html, index_html
from gradloc.agent.links import Denied
from gradloc.agent.page_precursors import preceding
from gradloc.agent.patterns import Patterns
from gradloc.agent.security import Security
from gradloc.agent.store_context import StoreContext, store_context
from gradloc.errors import GradlocError
from gradloc.exporters.prometheus import make_registry, render
from gradloc.records import to_dict
from gradloc.reports import CorrelatedIncident
from gradloc.store.errors import AmbiguousIdError
from gradloc.store.incident_json import correlated_to_dict

log = logging.getLogger(__name__)
PAGE_PATTERNS_S = 7 * 86400.0  # the index page's patterns window without ?since= (the CLI and the API: any window)
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
CSP = "default-src 'none'; style-src 'unsafe-inline'"  # the pages need nothing else: no script runs
FULL, PUBLIC, SIGNED = "full", "public", "signed"  # what a request may see: everything, an open route, one page


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
    timeout = 30  # seconds a connection may idle (and a TLS handshake may take)

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # a failure ends this request only (handle_error logs it)

    def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, not stderr
        log.debug("http %s", links.redact(fmt % args))

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        try:
            grant = self._grant(url.path, url.query)
        except Denied as denied:
            self.close_connection = True
            return self._deny(url.path, denied)
        try:
            if url.path == "/metrics":  # exemplars carry signed links only for a scrape that sent the token
                registry = self.server.signed_registry if grant == FULL and self.server.signed_registry else \
                    self.server.registry
                body, ctype = render(registry, self.headers.get("Accept"))
                return self._send(200, body, ctype)
            if url.path == "/healthz":
                return self._json(200, self.server.health())
            if url.path.rstrip("/") == "/incidents":
                query = parse_qs(url.query)
                core = self.server.core
                return self._html(200, index_html(api_rows.incident_rows(core, query),
                                                  outliers=api_rows.outlier_rows(core, query),
                                                  precursors=api_rows.precursor_rows(core, query),
                                                  link=self._page_link if self.server.signer else None,
                                                  patterns=self.server.page_patterns(query)))
            if url.path.startswith("/incidents/trace/"):  # an exemplar's trace id -> its incident's page
                found = self.server.incident_id_of_trace(url.path.rsplit("/", 1)[1])
                if found is None:
                    return self._html(404, index_html([]).replace("<h1>Incidents</h1>", "<h1>No such trace</h1>"))
                sig = None
                if grant == SIGNED:  # the page's own link, with the same expiry
                    sig = self.server.signer.sign(links.INCIDENT, found, links.expiry(self._sig(url.query) or ""))
                return self._send(302, b"", "text/plain", {"Location": links.page_path(found, sig)})
            if url.path.startswith("/incidents/"):
                key = url.path.rsplit("/", 1)[1]
                inc = self.server.incident(key)
                if grant == SIGNED and inc is not None and inc.incident_id != key:  # signed for exactly one id
                    raise Denied(403, "invalid")
                return self._html(200, incident_html(inc, self.server.context(inc))) \
                    if inc is not None else \
                    self._html(404, index_html([]).replace("<h1>Incidents</h1>", "<h1>No such incident</h1>"))
            if url.path.rstrip("/") == "/api/incidents":
                rows = self.server.list_incidents(parse_qs(url.query))
                for row in rows:  # a link that opens the page in a browser (signed when there is a token)
                    row["link"] = self._page_link(row["incident_id"])
                return self._json(200, rows)
            if url.path.rstrip("/") == "/api/outliers":  # per-sample findings (SampleOutlier), newest first
                return self._json(200, [to_dict(o) for o in api_rows.outlier_rows(self.server.core, parse_qs(url.query))])
            if url.path.rstrip("/") == "/api/precursors":  # the drift detector's findings (PrecursorFinding), newest first
                return self._json(200, [to_dict(f) for f in api_rows.precursor_rows(self.server.core, parse_qs(url.query))])
            if url.path.rstrip("/") == "/api/quarantine":  # the list a resumed run keeps out (QuarantineList.from_agent)
                if self.server.core.store is None:
                    raise ValueError("the quarantine lives in the incident store (this daemon runs with --db none)")
                return self._json(200, [to_dict(e) for e in self.server.core.store.quarantine.list()])
            if url.path.rstrip("/") == "/api/patterns":  # culprits and outliers per data group (agent/patterns.py)
                return self._json(200, to_dict(self.server.patterns(parse_qs(url.query))))
            if url.path.startswith("/api/incidents/"):
                inc = self.server.get_incident(url.path.rsplit("/", 1)[1])
                return self._json(200, inc) if inc is not None else self._json(404, {"error": "no such incident"})
            self._json(404, {"error": f"no route {url.path}"})
        except Denied as denied:
            self._deny(url.path, denied)
        except (ValueError, GradlocError) as exc:  # bad query, ambiguous id prefix
            self._json(400, {"error": str(exc)})
        except Exception:  # noqa: BLE001 - a request never takes the server down
            log.exception("gradloc agent: %s failed", url.path)
            self._json(500, {"error": "internal error (see the agent's log)"})

    def _html(self, code: int, page: str, headers: dict[str, str] | None = None) -> None:
        self._send(code, page.encode(), "text/html; charset=utf-8", {"Content-Security-Policy": CSP,
                                                                       "X-Content-Type-Options": "nosniff",
                                                                       **(headers or {})})

    def _grant(self, path: str, query: str) -> str:
        """FULL (no token, or the right bearer header), PUBLIC (an open route) or SIGNED (a signed link's
        page); raises :class:`Denied` (401 without credentials, 403 for a link that does not open this page)."""
        sec, signer = self.server.security, self.server.signer
        if sec is None or not sec.token or sec.allows(self.headers.get("Authorization")):
            return FULL
        if path == "/healthz" or (path == "/metrics" and sec.metrics_open):
            return PUBLIC
        sig, target = self._sig(query), links.page_target(path)
        if not sig or target is None or signer is None:  # an exemplar without a sig label gives "sig="
            raise Denied(401, "missing")
        reason = signer.check(*target, sig)
        if reason is not None:
            raise Denied(403, reason, sig)
        return SIGNED

    @staticmethod
    def _sig(query: str) -> str | None:
        values = parse_qs(query, keep_blank_values=True).get(links.SIG)
        return values[-1] if values else None

    def _deny(self, path: str, denied: Denied) -> None:
        headers = {"WWW-Authenticate": 'Bearer realm="gradloc-agent"'} if denied.code == 401 else {}
        if path.startswith("/incidents"):  # a browser: a page that says what is wrong, never the incident
            return self._html(denied.code, links.denied_html(denied.reason, denied.sig), headers)
        self._json(denied.code, {"error": "missing or wrong bearer token (Authorization: Bearer <token>)"}, headers)

    def _page_link(self, incident_id: str) -> str:
        signer = self.server.signer
        base = links.origin(self.headers.get("Host"), self.server.server_address[:2], self.server.tls)
        return base + links.page_path(incident_id, signer.mint(links.INCIDENT, incident_id) if signer else None)

    def _json(self, code: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send(code, json_text(payload).encode(), "application/json; charset=utf-8", headers)

    def _send(self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], core: AgentCore, security: Security | None = None) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.core, self.registry, self.started = core, make_registry(core.state), time.time()
        self.security = security
        self._tls = security.ssl_context() if security is not None and security.tls else None
        self.tls = self._tls is not None
        self.signer = links.LinkSigner(security.token, security.link_ttl_s) \
            if security is not None and security.token else None
        self.signed_registry = make_registry(core.state, self.signer.for_exemplar) if self.signer else None

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("gradloc agent: http connection from %s failed", client_address, exc_info=True)

    def get_request(self) -> tuple[socket.socket, Any]:
        """Accept; with TLS, wrap without the handshake: it runs in the request's thread (_Handler.setup),
        so a client that connects and stalls never holds up the accept loop."""
        conn, addr = self.socket.accept()
        if self._tls is not None:
            conn = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, addr

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "uptime_s": round(time.time() - self.started, 3),
                "pending_incidents": self.core.correlator.pending, "queued": self.core.queued,
                "jobs": self.core.activity.jobs, "ranks": self.core.activity.ranks,
                "store": self.core.store is not None}

    def context(self, inc: CorrelatedIncident) -> StoreContext:
        """What the store knows around ``inc`` for its page; without a store, the remembered drift findings before it."""
        if self.core.store is not None:
            return store_context(self.core.store, inc)
        return StoreContext(preceded=preceding(list(self.core.recent_precursors), inc.job, inc.step))

    def patterns(self, query: dict[str, list[str]]) -> Patterns:
        """``?job=&since=&until=``: the store's patterns (gradloc/agent/patterns.py); a daemon without a store has none."""
        if self.core.store is None:
            raise ValueError("patterns need the incident store (this daemon runs with --db none)")
        return patterns.from_store(self.core.store, job=query.get("job", [None])[-1],
                                   since_unix=api_rows.query_float(query, "since", None),
                                   until_unix=api_rows.query_float(query, "until", None))

    def page_patterns(self, query: dict[str, list[str]]) -> Patterns | None:
        """The index page's patterns: the query's job and ``since``, else the last PAGE_PATTERNS_S (None: no store)."""
        if self.core.store is None:
            return None
        since = api_rows.query_float(query, "since", None)
        return patterns.from_store(self.core.store, job=query.get("job", [None])[-1],
                                   since_unix=since if since is not None else time.time() - PAGE_PATTERNS_S)

    def list_incidents(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        return [to_dict(r) for r in api_rows.incident_rows(self.core, query)]

    def incident(self, incident_id: str) -> CorrelatedIncident | None:
        if self.core.store is not None:
            return self.core.store.get_incident(incident_id)
        return recent_incident(self.core.recent, incident_id)

    def incident_id_of_trace(self, trace_id: str) -> str | None:
        if not _TRACE_ID.fullmatch(trace_id):
            raise ValueError("a trace id is 32 lowercase hex digits")
        if self.core.store is not None:
            return self.core.store.incident_id_of_trace(trace_id)
        return next((i.incident_id for i in self.core.recent if i.trace_id == trace_id), None)

    def get_incident(self, incident_id: str) -> dict[str, Any] | None:
        inc = self.incident(incident_id)
        return None if inc is None else correlated_to_dict(inc)


def recent_incident(recent: Iterable[CorrelatedIncident], key: str) -> CorrelatedIncident | None:
    """Without a store, the remembered incident ``key`` names, as the store would answer: the one
    whose id or one of whose rank findings' ids (what the training process printed) is ``key``,
    else the one such an id starts with; several: :class:`AmbiguousIdError`."""
    key = key.strip()
    if not key:
        raise ValueError("an incident id (or a prefix of one) is required")
    incidents = list(recent)  # a snapshot: the agent's worker appends meanwhile

    def ids(inc: CorrelatedIncident) -> tuple[str, ...]:
        return (inc.incident_id, *(f.incident_id for f in inc.findings))

    exact = [inc for inc in incidents if key in ids(inc)]
    if exact:
        return exact[-1]
    found = {inc.incident_id: inc for inc in incidents if any(i.startswith(key) for i in ids(inc))}
    if len(found) > 1:
        raise AmbiguousIdError(key, tuple(sorted(found)))
    return next(iter(found.values()), None)


class AgentHttpServer:
    """Owns the server thread; ``address`` is the bound (host, port)."""

    def __init__(self, core: AgentCore, address: str = "127.0.0.1:0", security: Security | None = None) -> None:
        self._server = _Server(parse_address(address), core, security)
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._server.serve_forever, name="gradloc-agent-http",
                                        kwargs={"poll_interval": 0.2}, daemon=True)

    def start(self) -> "AgentHttpServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever: never call it on a server never started
            self._server.shutdown()
        self._server.server_close()
