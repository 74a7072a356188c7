"""Signed page links: one incident's page opens without the bearer token, and nothing else does.

With an auth token every HTTP request needs ``Authorization: Bearer <token>``, which a browser that
follows a link (from Grafana, a chat message, a terminal) cannot send. A signed link carries, instead
of the token, a short-lived HMAC over the one page it opens::

    /incidents/<incident id>?sig=<expiry>.<mac>        the incident's page
    /incidents/trace/<trace id>?sig=<expiry>.<mac>     302 to the page above, signed with the same expiry

``<expiry>`` is a unix time (seconds); ``<mac>`` is the first 16 bytes of
HMAC-SHA256(key, "<kind>\\n<id>\\n<expiry>"), base64url without padding (22 characters), kind
``incident`` or ``trace``; key = HMAC-SHA256(auth token, "gradloc-agent signed page links v1"), so
rotating the token revokes every link, and without a token there is nothing to sign (every page is
open anyway). Checked in constant time (:func:`hmac.compare_digest`). A link grants a GET of that one
page only: ``/api/*``, ``/metrics`` (unless ``metrics_open``), the index and every other incident stay
behind the token, and a tampered, expired or other-page link gets a 403 page that never contains the
incident (:meth:`LinkSigner.check`, ``gradloc/agent/http.py``).

**TTL** (``link_ttl_s``, default 1 day, at most 30 days, validated by :class:`AgentConfig`): long
enough to click yesterday's spike on a dashboard, short enough that a link pasted somewhere stops
working. An expired link's page says how to get a fresh one.

**Where links are minted.**

- *Exemplars* (``/metrics``, OpenMetrics): next to ``trace_id`` each exemplar carries
  ``sig="<expiry>.<mac>"`` for ``/incidents/trace/<trace id>``, with expiry = the incident's close
  time + TTL — the same label set at every scrape, so Prometheus stores one exemplar per incident, not
  one per scrape (the OpenMetrics limit of 128 characters for an exemplar's labels: trace_id 40 + sig
  36 = 76). Only a scrape that sent the token gets them: an open ``/metrics`` (``metrics_open``) never
  hands out links, so give Prometheus the token (``authorization: {credentials_file: ...}``) to get
  clickable exemplars.
- ``/api/incidents``: each row's ``link`` (absolute, signed at request time, expiry now + TTL).
- ``gradloc-agent incidents show ID``: prints the link (``config.cli_page_link``; signed when the
  environment or config file holds the token).

**Why this works when clicked in Grafana.** Grafana builds a link at click time from the data under
the cursor; it cannot ask the daemon for a signature. An exemplar's data frame holds one field per
label, the series labels and the exemplar's own (``pkg/promlib/querydata/exemplar``: Grafana's own
Tempo link reads ``${__data.fields["span_id"]}`` that way), so the provisioned datasource's exemplar
link is ``<scheme>://${__data.fields["instance"]}/incidents/trace/${__value.raw}?sig=${__data.fields["sig"]}``:
``instance`` (Prometheus' scrape target: this daemon's HTTP server, which serves the pages) picks the
daemon that holds the incident, and ``sig`` is what that daemon minted. The trace-id form is what
the exemplar has (an incident id would not fit next to it), and the redirect re-signs for the page.
Dashboard table/series links (``/incidents?job=``) open the index, which a signed link never opens:
with a token they need a proxy that adds it (docs/grafana.md).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import html
import math
import re
import socket
import time
from collections.abc import Callable
from urllib.parse import quote

SIG = "sig"  # the query parameter (and exemplar label)
INCIDENT, TRACE = "incident", "trace"
DEFAULT_TTL_S = 86_400.0
MAX_TTL_S = 30 * 86_400.0
_KEY_INFO = b"gradloc-agent signed page links v1"
_MAC_BYTES = 16
_SIG_RE = re.compile(r"(\d{1,12})\.([A-Za-z0-9_-]{22})")
_ID_RE = re.compile(r"[0-9A-Za-z_-]{1,128}")
_HOST_RE = re.compile(r"[A-Za-z0-9.-]{1,253}(:\d{1,5})?|\[[0-9A-Fa-f:.]{2,45}\](:\d{1,5})?")
_SIG_IN_LOG = re.compile(r"(\bsig=)[^&\s\"]*")


class LinkSigner:
    """Mints and checks signed links with a key derived from the auth token (never kept, never shown)."""

    __slots__ = ("_key", "ttl_s", "_clock")

    def __init__(self, token: str, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time) -> None:
        if not token:
            raise ValueError("signed links need the auth token")
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"link_ttl_s must be in (0, {MAX_TTL_S:g}], got {ttl_s!r}")
        self._key = hmac.new(token.encode(), _KEY_INFO, hashlib.sha256).digest()
        self.ttl_s, self._clock = float(ttl_s), clock

    def __repr__(self) -> str:
        return f"LinkSigner(ttl_s={self.ttl_s:g})"

    def _mac(self, kind: str, ident: str, expires: int) -> str:
        digest = hmac.new(self._key, f"{kind}\n{ident}\n{expires}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest[:_MAC_BYTES]).rstrip(b"=").decode("ascii")

    def sign(self, kind: str, ident: str, expires: int) -> str:
        """``<expires>.<mac>``: the ``sig`` value opening page ``kind``/``ident`` until ``expires``."""
        return f"{int(expires)}.{self._mac(kind, ident, int(expires))}"

    def mint(self, kind: str, ident: str, now: float | None = None) -> str:
        """A ``sig`` valid for the TTL from ``now``."""
        return self.sign(kind, ident, math.ceil((self._clock() if now is None else now) + self.ttl_s))

    def for_exemplar(self, trace_id: str, time_unix: float) -> str | None:
        """The exemplar's ``sig``: for the trace redirect, expiring TTL after the incident closed (the same
        value at every scrape). None for a trace id or time that cannot be signed."""
        if not _ID_RE.fullmatch(trace_id) or not math.isfinite(time_unix) or time_unix <= 0:
            return None
        return self.sign(TRACE, trace_id, math.ceil(time_unix + self.ttl_s))

    def check(self, kind: str, ident: str, sig: str | None, now: float | None = None) -> str | None:
        """None when ``sig`` opens page ``kind``/``ident`` now; else why not: "malformed", "invalid"
        (tampered, for another page, or from another token) or "expired"."""
        match = _SIG_RE.fullmatch(sig or "")
        if match is None or not _ID_RE.fullmatch(ident):
            return "malformed"
        expires = int(match[1])
        if not hmac.compare_digest(self._mac(kind, ident, expires).encode(), match[2].encode()):
            return "invalid"
        if (self._clock() if now is None else now) > expires:
            return "expired"
        return None


class Denied(Exception):
    """A request refused: 401 (no credentials) or 403 (a link that does not open this page), and why."""

    def __init__(self, code: int, reason: str, sig: str | None = None) -> None:
        super().__init__(reason)
        self.code, self.reason, self.sig = code, reason, sig


def expiry(sig: str) -> int:
    """The expiry of a well-formed ``sig`` (check it first)."""
    return int(sig.partition(".")[0])


def page_target(path: str) -> tuple[str, str] | None:
    """(kind, id) of a page a signed link may open, or None: ``/incidents/<id>``, ``/incidents/trace/<id>``."""
    for prefix, kind in (("/incidents/trace/", TRACE), ("/incidents/", INCIDENT)):
        if path.startswith(prefix):
            ident = path[len(prefix):]
            return (kind, ident) if _ID_RE.fullmatch(ident) else None
    return None


def page_path(incident_id: str, sig: str | None = None) -> str:
    return f"/incidents/{quote(incident_id, safe='')}" + (f"?{SIG}={sig}" if sig else "")


def origin(host_header: str | None, bound: tuple[str, int], tls: bool) -> str:
    """``scheme://host:port`` a client reaches this server at: the request's Host header when it looks
    like one, else the bound address (this machine's name for a wildcard address)."""
    if host_header and _HOST_RE.fullmatch(host_header.strip()):
        host = host_header.strip()
    else:
        name, port = bound[0], bound[1]
        name = socket.getfqdn() if name in ("", "0.0.0.0", "::") else name
        host = f"[{name}]:{port}" if ":" in name else f"{name}:{port}"
    return f"{'https' if tls else 'http'}://{host}"


def redact(text: str) -> str:
    """An access-log line without link signatures (a signature opens a page like a password would)."""
    return _SIG_IN_LOG.sub(r"\1…", text)


_DENIED = {
    "missing": "This page needs the agent's token (<code>Authorization: Bearer &lt;token&gt;</code>) or a signed "
               "link. Signed links come from the Grafana exemplar dots, the <code>link</code> field of "
               "<code>/api/incidents</code> and <code>gradloc-agent incidents show ID</code>; exemplars carry them "
               "when Prometheus scrapes with the token. The incident list needs the token (a proxy that adds it).",
    "malformed": "This link's signature is not well-formed.",
    "invalid": "This link is not valid for this page: it was changed, or signed for another page or with another "
               "token.",
    "expired": "This link expired{when}. Get a fresh one: <code>gradloc-agent incidents show ID</code> on the "
               "agent's node, or the <code>link</code> of <code>/api/incidents</code> (with the token).",
}


def denied_html(reason: str, sig: str | None = None) -> str:
    """The 401/403 page: what is wrong and how to get in; never anything of an incident."""
    when = ""
    if reason == "expired" and sig:
        when = time.strftime(" at %Y-%m-%d %H:%M:%S UTC", time.gmtime(expiry(sig)))
    text = _DENIED.get(reason, _DENIED["invalid"]).format(when=html.escape(when))
    title = "Token or signed link needed" if reason == "missing" else "Link refused"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
            f"<body><h1>{title}</h1><p>{text}</p></body></html>\n")
