"""Who may talk to the agent: loopback by default, a bearer token and TLS to go beyond it.

- **Binding.** The daemon binds 127.0.0.1 by default. A non-loopback address (``0.0.0.0``, a LAN
  IP, ``[::]``) is refused unless an auth token is configured or ``insecure`` says the network is
  trusted (:func:`check_exposure`).
- **Token.** ``auth_token`` (``GRADLOC_AGENT_AUTH_TOKEN``, or ``auth_token_file``: never a flag,
  since a command line is visible to every user of the machine) is required on every ingest call
  (gRPC metadata ``authorization: Bearer <token>``) and every HTTP request (the same header), except
  ``/healthz`` and, with ``metrics_open``, ``/metrics`` (for a Prometheus that cannot send a header).
  Compared in constant time; never logged (reprs hide it).
- **Signed links.** One incident's page opens without the token through a short-lived link signed
  with a key derived from it (``link_ttl_s``; gradloc/agent/links.py): a browser cannot send a header.
- **TLS.** ``tls_cert`` + ``tls_key`` (PEM files) turn on TLS for both gRPC and HTTP.
"""
from __future__ import annotations

import hmac
import ipaddress
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from gradloc.agent.links import DEFAULT_TTL_S
from gradloc.errors import ConfigError

BEARER = "bearer "


@dataclass(frozen=True)
class Security:
    token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    metrics_open: bool = False
    link_ttl_s: float = DEFAULT_TTL_S  # how long a signed page link opens its page (gradloc/agent/links.py)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header / metadata value carries the token (True without one)."""
        if not self.token:
            return True
        if not authorization or not authorization.lower().startswith(BEARER):
            return False
        return hmac.compare_digest(authorization[len(BEARER):].strip().encode(), self.token.encode())

    def grpc_credentials(self):  # noqa: ANN201 - grpc.ServerCredentials
        import grpc

        key, cert = Path(self.tls_key or "").read_bytes(), Path(self.tls_cert or "").read_bytes()
        return grpc.ssl_server_credentials([(key, cert)])

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.tls_cert or "", self.tls_key or "")
        return ctx


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to anything


def check_exposure(addresses: dict[str, str], token: str | None, insecure: bool) -> None:
    """Refuse a non-loopback binding without a token, unless ``insecure`` was said explicitly."""
    exposed = [f"{name} {addr}" for name, addr in addresses.items() if not is_loopback(addr.rpartition(":")[0])]
    if exposed and not token and not insecure:
        raise ConfigError(f"{', '.join(exposed)} is reachable beyond this machine, and incidents carry training "
                          "text: set an auth token (GRADLOC_AGENT_AUTH_TOKEN or auth_token_file), or pass "
                          "--insecure if the network is trusted")


def read_token(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"auth_token_file: cannot read {path}: {exc.strerror}") from exc
    if not token:
        raise ConfigError(f"auth_token_file: {path} is empty")
    return token
