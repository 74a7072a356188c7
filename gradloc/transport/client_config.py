"""Typed configuration of :class:`~gradloc.transport.client.AgentClient`, validated on construction
(a wiring mistake raises :class:`~gradloc.errors.ConfigError` at setup, never later on the hot path)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from gradloc.errors import ConfigError
from gradloc.transport.validate import MAX_WORLD_SIZE


@dataclass(frozen=True)
class ClientConfig:
    address: str
    job: str
    rank: int
    world_size: int = 1
    queue_size: int = 4096
    max_batch: int = 256
    max_batch_bytes: int = 4 * 1024 * 1024  # keep batches well under the daemon's 16 MiB limit
    flush_interval_s: float = 0.2
    timeout_s: float = 5.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 10.0
    token: str | None = field(default=None, repr=False)  # the daemon's bearer token (never logged)
    tls: bool = False  # TLS to the daemon (implied by tls_ca)
    tls_ca: str | None = None  # PEM file of the CA (or self-signed certificate) to trust; None: the system's

    def __post_init__(self) -> None:
        checks = [
            (bool(self.address) and ":" in self.address, f"address must be host:port, got {self.address!r}"),
            (bool(self.job), "job must be a non-empty string"),
            (1 <= self.world_size <= MAX_WORLD_SIZE,
             f"world_size must be in 1..{MAX_WORLD_SIZE} (what the daemon accepts), got {self.world_size}"),
            (0 <= self.rank < self.world_size, f"rank must be in [0, world_size={self.world_size}), got {self.rank}"),
            (self.queue_size >= 1, f"queue_size must be >= 1, got {self.queue_size}"),
            (self.max_batch >= 1, f"max_batch must be >= 1, got {self.max_batch}"),
            (self.max_batch_bytes >= 1024, f"max_batch_bytes must be >= 1024, got {self.max_batch_bytes}"),
            (self.flush_interval_s > 0, f"flush_interval_s must be > 0, got {self.flush_interval_s}"),
            (self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}"),
            (0 < self.backoff_initial_s <= self.backoff_max_s,
             f"need 0 < backoff_initial_s <= backoff_max_s, got {self.backoff_initial_s}, {self.backoff_max_s}"),
        ]
        checks.append((self.tls_ca is None or os.path.isfile(self.tls_ca), f"tls_ca: no such file {self.tls_ca!r}"))
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"AgentClient: {msg}")
