"""The daemon's configuration: defaults < config file (TOML) < environment < command-line flags.

Every setting has one name used everywhere: ``straggler_deadline_s`` is the TOML key
``straggler_deadline_s``, the variable ``GRADLOC_AGENT_STRAGGLER_DEADLINE_S`` and the flag
``--straggler-deadline-s``. The merged result is validated once, on construction.
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Mapping

from gradloc.agent.links import DEFAULT_TTL_S, INCIDENT, MAX_TTL_S, LinkSigner, origin, page_path
from gradloc.agent.security import Security, check_exposure, read_token
from gradloc.errors import ConfigError

ENV_PREFIX = "GRADLOC_AGENT_"


@dataclass(frozen=True)
class AgentConfig:
    ingest: str = "127.0.0.1:50917"  # gRPC ingest (trainers connect here)
    http: str = "127.0.0.1:9917"  # /metrics, /healthz, /api/incidents
    # incident store: a SQLite file or a postgresql:// URL (repr=False: it may hold a password); "" = the per-user
    # default, "none" = no store
    db: str = field(default="", repr=False)
    otlp_endpoint: str = ""  # forward metrics and traces over OTLP/gRPC, e.g. localhost:4317
    otlp_interval_s: float = 10.0
    otlp_insecure: bool = True
    straggler_deadline_s: float = 10.0
    max_message_bytes: int = 16 * 1024 * 1024
    queue_size: int = 16  # decoded ingest batches waiting for the core (~3 MB each at 256 layers × 256 records)
    retention_days: float = 30.0
    retention_incidents: int = 10_000
    retention_step_rows: int = 1_000_000  # per job
    job_retention_s: float = 3600.0  # a job (rank) silent this long has ended: its series and state are dropped
    log_level: str = "info"
    max_incidents_per_minute: int = 600  # per job; beyond: dropped, counted (gradloc/agent/limits.py)
    max_culprits: int = 256  # per incident; beyond: cut, counted
    max_layers: int = 1024  # layer series per rank in /metrics and OTLP; beyond: counted series_dropped
    max_series: int = 4096  # (job, rank) pairs tracked with live series; beyond: counted series_dropped
    sources: str = ""  # comma-separated data sources that always get their own source label (exporters/source_labels.py)
    max_sources: int = 16  # other sources labelled by name, first seen first; later ones are "other"
    auth_token: str = field(default="", repr=False)  # GRADLOC_AGENT_AUTH_TOKEN / TOML; never a flag
    auth_token_file: str = ""  # or read the token from this file
    insecure: bool = False  # allow a non-loopback binding without a token (a trusted network)
    metrics_open: bool = False  # /metrics without the token (a Prometheus that cannot send one)
    tls_cert: str = ""  # PEM certificate (chain): TLS for gRPC ingest and HTTP
    tls_key: str = ""  # its PEM private key
    link_ttl_s: float = DEFAULT_TTL_S  # signed page links (token-free, one incident each) open this long
    quarantine_culprits: bool = False  # quarantine every sample a located incident names (agent/quarantine_policy.py)
    quarantine_outlier_z: float = 0.0  # and every surprise outlier at or above this z (0: none)

    def __post_init__(self) -> None:
        for name in ("ingest", "http"):
            host, _, port = getattr(self, name).rpartition(":")
            if not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"{name}: expected host:port, got {getattr(self, name)!r}")
        positive = ("otlp_interval_s", "straggler_deadline_s", "max_message_bytes", "queue_size",
                    "retention_days", "retention_incidents", "retention_step_rows", "max_incidents_per_minute",
                    "max_culprits", "max_layers", "max_series", "job_retention_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_sources < 0:
            raise ConfigError(f"max_sources must be >= 0, got {self.max_sources!r}")
        if any(not x.strip() for x in self.sources.split(",")) and self.sources:
            raise ConfigError(f"sources: a comma-separated list of names, got {self.sources!r}")
        if not self.quarantine_outlier_z >= 0:
            raise ConfigError(f"quarantine_outlier_z must be >= 0 (0: off), got {self.quarantine_outlier_z!r}")
        if not 0 < self.link_ttl_s <= MAX_TTL_S:  # NaN fails too
            raise ConfigError(f"link_ttl_s must be > 0 and at most {MAX_TTL_S:g} (30 days), got {self.link_ttl_s!r}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug|info|warning|error, got {self.log_level!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key go together (PEM files)")
        for name in ("tls_cert", "tls_key"):
            if getattr(self, name) and not os.path.isfile(getattr(self, name)):
                raise ConfigError(f"{name}: no such file {getattr(self, name)!r}")
        if self.auth_token and self.auth_token_file:
            raise ConfigError("give auth_token or auth_token_file, not both")
        check_exposure({"ingest": self.ingest, "http": self.http}, self.token, self.insecure)

    @property
    def token(self) -> str | None:
        """The auth token (read from ``auth_token_file`` when that is set); None when there is none."""
        if self.auth_token_file:
            return read_token(self.auth_token_file)
        return self.auth_token or None

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(x.strip() for x in self.sources.split(",")) if self.sources else ()

    def security(self) -> Security:
        return Security(self.token, self.tls_cert or None, self.tls_key or None, self.metrics_open, self.link_ttl_s)


FIELDS = {f.name: f for f in dataclasses.fields(AgentConfig)}


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = type(getattr(AgentConfig(), name))
    try:
        if kind is bool and isinstance(value, str):
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("1", "true", "yes")
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {name} must be {kind.__name__}, got {value!r}") from exc


def from_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc
    table = raw.get("agent", raw)  # either top-level keys or an [agent] table
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
    return {k: _coerce(k, v, path) for k, v in table.items()}


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out = {}
    for key, value in env.items():
        if key.startswith(ENV_PREFIX) and key != ENV_PREFIX + "CONFIG":
            name = key[len(ENV_PREFIX):].lower()
            if name not in FIELDS:
                raise ConfigError(f"environment: unknown setting {key}")
            out[name] = _coerce(name, value, key)
    return out


def load_config(file: str | None = None, env: Mapping[str, str] | None = None,
                flags: Mapping[str, Any] | None = None) -> AgentConfig:
    """Merge the sources (later wins); ``flags`` holds only the flags the user actually gave."""
    env = os.environ if env is None else env
    file = file or env.get(ENV_PREFIX + "CONFIG")
    merged: dict[str, Any] = {}
    if file:
        merged.update(from_file(file))
    merged.update(from_env(env))
    merged.update({k: _coerce(k, v, f"--{k.replace('_', '-')}") for k, v in (flags or {}).items()})
    return AgentConfig(**merged)


def cli_page_link(incident_id: str, env: Mapping[str, str] | None = None) -> str | None:
    """The page link ``incidents show`` prints: this node's daemon (the agent config: ``http``, TLS,
    the token, ``link_ttl_s``, from GRADLOC_AGENT_* / $GRADLOC_AGENT_CONFIG), signed when a token is
    configured; None when the agent config is invalid here."""
    try:
        cfg = load_config(None, os.environ if env is None else env)
        token = cfg.token
    except ConfigError:
        return None
    host, _, port = cfg.http.rpartition(":")
    base = origin(None, (host.strip("[]") or "127.0.0.1", int(port)), bool(cfg.tls_cert))
    sig = LinkSigner(token, cfg.link_ttl_s).mint(INCIDENT, incident_id) if token else None
    return base + page_path(incident_id, sig)
