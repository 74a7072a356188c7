"""Where ``gradloc-agent incidents …`` reads: a daemon's HTTP API, or an incident store, and it says which.

Resolution (first that applies):

1. ``--db PATH|URL`` on the command line: that store (a SQLite file or a ``postgresql://`` URL) (``--agent`` with it is a usage error).
2. ``--agent HOST:PORT`` (or ``http(s)://HOST:PORT``): that daemon's HTTP API (``/api/incidents``), its
   token and TLS from the agent config below. Unreachable: exit 1 with a message naming the address;
   no store is read instead (the message names the local store to pass as ``--db``).
3. ``$GRADLOC_DB``: that store (said on stderr: no flag named it).
4. The daemon's own configuration, read as ``gradloc-agent serve`` reads it (``$GRADLOC_AGENT_CONFIG``
   and ``GRADLOC_AGENT_*``: ``http``, ``db``, the token, TLS): its HTTP address when a daemon answers there
   (``/healthz``), else the store it names (``db``, else the per-user default), with one stderr line
   naming the address that did not answer and the store read instead (or that there is none).

A store is named in messages without its password (a URL's). Page links are built for the daemon actually read (its address, signed when the config holds the
token); reading a store with no daemon answering prints no link, since none would open.
Nothing here imports torch (the store module only for its default path).
"""
from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

PROBE_TIMEOUT_S = 2.0  # /healthz of an implied daemon: a refused connection answers at once
READ_TIMEOUT_S = 30.0


class AgentUnreachable(Exception):
    """The daemon did not answer (or refused the request): the message says where and why."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """Resolved: a daemon's API (``agent``: ``scheme://host:port``) or a store (``store``), and ``said``:
    the stderr line naming it (empty when the user named it with a flag)."""

    agent: str | None = None
    store: Path | str | None = None  # a SQLite file, or a postgresql:// URL
    said: str = ""
    token: str | None = None
    cafile: str | None = None
    link_ttl_s: float = 86_400.0

    def __post_init__(self) -> None:
        if (self.agent is None) == (self.store is None):
            raise ValueError("a source is a daemon or a store, exactly one")

    # -- the daemon's API ------------------------------------------------------------------------------------
    def fetch(self, path: str, params: Mapping[str, Any] | None = None, timeout_s: float = READ_TIMEOUT_S) -> bytes:
        """GET ``path`` from the daemon (with the token); AgentUnreachable on no answer, 401/403 or a 5xx;
        a 404's body comes back as LookupError, a 400's as ValueError (the daemon's message)."""
        query = urlencode({k: v for k, v in (params or {}).items() if v is not None})
        url = f"{self.agent}{path}" + (f"?{query}" if query else "")
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"} if self.token else {})
        context = ssl.create_default_context(cafile=self.cafile) if url.startswith("https:") else None
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=context) as resp:
                return resp.read()
        except urllib.error.HTTPError as err:
            message = _error_text(err)
            if err.code == 404:
                raise LookupError(message) from err
            if err.code == 400:
                raise ValueError(message) from err
            if err.code in (401, 403):
                raise AgentUnreachable(f"the agent at {self.agent} refused the request ({err.code}): it needs its "
                                       "token (GRADLOC_AGENT_AUTH_TOKEN, or auth_token_file in "
                                       "$GRADLOC_AGENT_CONFIG)") from err
            raise AgentUnreachable(f"the agent at {self.agent} answered {err.code}: {message}") from err
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AgentUnreachable(f"no gradloc agent answers at {self.agent} ({reason})") from exc

    def fetch_json(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        return json.loads(self.fetch(path, params))

    def page_link(self, incident_id: str) -> str | None:
        """The incident page on the daemon read (signed when the token is known); None for a store."""
        if self.agent is None:
            return None
        from gradloc.agent.links import INCIDENT, LinkSigner, page_path

        sig = LinkSigner(self.token, self.link_ttl_s).mint(INCIDENT, incident_id) if self.token else None
        return self.agent + page_path(incident_id, sig)


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(err.read()).get("error", err.reason))
    except (ValueError, AttributeError, OSError):
        return str(err.reason)


def agent_base(address: str, tls: bool) -> str:
    """``scheme://host:port`` to connect to: a wildcard bind address becomes loopback."""
    parts = urlsplit(address if "://" in address else f"{'https' if tls else 'http'}://{address}")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"expected HOST:PORT or http(s)://HOST:PORT, got {address!r}")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(parts.hostname, parts.hostname)
    return f"{parts.scheme}://" + (f"[{host}]" if ":" in host else host) + f":{parts.port}"


def resolve(db: Path | str | None, db_from_env: bool, agent: str | None,
            env: Mapping[str, str] | None = None) -> Source:
    """The source per the module docstring; raises ValueError for conflicting or malformed options and
    AgentUnreachable for an ``--agent`` that does not answer."""
    from gradloc.agent.config import load_config
    from gradloc.errors import ConfigError
    from gradloc.store.backends import redact

    env = os.environ if env is None else env
    if db is not None and agent is not None and not db_from_env:
        raise ValueError("give --db (a store) or --agent (a daemon), not both")
    if db is not None and not db_from_env:
        return Source(store=db)  # named by its flag: nothing to say
    try:
        cfg, problem = load_config(None, env), ""
    except ConfigError as exc:
        cfg, problem = None, f" (the agent config is not usable here: {exc})"
    auth = dict(token=cfg.token, cafile=cfg.tls_cert or None, link_ttl_s=cfg.link_ttl_s) if cfg else {}
    if agent is not None:
        source = Source(agent=agent_base(agent, bool(cfg and cfg.tls_cert)), **auth)
        try:
            source.fetch("/healthz", timeout_s=PROBE_TIMEOUT_S)
        except AgentUnreachable as exc:
            local = _local_store(cfg)
            hint = f" the local store is {redact(local)}: pass --db {redact(local)} to read it" if local else \
                " no local store exists"
            raise AgentUnreachable(f"{exc}; not reading a store instead ({hint.strip()})") from exc
        return source
    if db is not None:  # from $GRADLOC_DB
        return Source(store=db, said=f"reading the store {redact(db)} ($GRADLOC_DB)")
    if cfg is not None:
        implied = Source(agent=agent_base(cfg.http, bool(cfg.tls_cert)), **auth)
        try:
            implied.fetch("/healthz", timeout_s=PROBE_TIMEOUT_S)
            return Source(agent=implied.agent, said=f"reading the agent at {implied.agent} (the agent config's "
                                                    "http; --agent HOST:PORT or --db PATH to choose)", **auth)
        except AgentUnreachable as exc:
            missed = f"{exc}; "
    else:
        missed = f"no agent address{problem}; "
    local = _local_store(cfg)
    if local is None:
        raise AgentUnreachable(f"{missed}and no incident store to read instead (pass --agent HOST:PORT or --db PATH)")
    return Source(store=local, said=f"{missed}reading the store {redact(local)}")


def _local_store(cfg: Any) -> Path | str | None:
    """The store the daemon's config names (``db``, else the per-user default) when it exists (a
    ``postgresql://`` URL is taken as existing: opening it says whether it does)."""
    from gradloc.store.backends import as_target, is_url
    from gradloc.store.sqlite import default_db_path

    if cfg is not None and cfg.db.lower() == "none":
        return None
    target = as_target(cfg.db) if cfg is not None and cfg.db else default_db_path()
    return target if is_url(target) or Path(target).exists() else None


def quoted(incident_id: str) -> str:
    return quote(incident_id.strip(), safe="")
