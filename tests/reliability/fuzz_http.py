"""Generated request targets for the daemon's HTTP API, and a raw-socket GET that sends them as they are.

``urllib``/``http.client`` refuse (or quote) targets with spaces, control characters or NUL; the
point here is what the server does with them, so the request line is written byte for byte.
"""
from __future__ import annotations

import random
import socket
from urllib.parse import quote

ROUTES = ("/api/incidents",) * 8 + ("/api/incidents/",) * 2 + ("/api/incidents/{id}",) * 5 + (
    "/metrics", "/metrics", "/healthz", "/", "/api", "/api/incidents/{id}/spans", "/api/steps", "/favicon.ico")
PARAMS = ("limit", "since", "job") * 6 + ("rank", "step", "format", "", "limit[]", "LIMIT", "jоb", "🙂", "x" * 300)
NUMBERS = ("0", "-1", "1", "10000", "10001", "1e3", "1.5", "nan", "NaN", "inf", "-inf", "1e999", "9" * 5000,
           "0x10", "1_000", "１２", "٣", "", " 5 ", "+7", "--1", "1e-400", "999999999999999999999999", "true",
           "%00", "\x00", "abc")
PIECES = ("..", ".", "%2e%2e", "%2F", "//", "\\", "%00", "\x00", "%", "%zz", "%ff%fe", "%c0%af", "?", "#", ";",
          "&", "=", "+", " ", "\t", "\x7f", "é", "🙂", "\u202e", "%F0%9F%99%82", "api", "incidents", "metrics",
          "~", "*", "'", "\"", "<script>", "%0d%0aX-Injected: 1")


class Requests:
    """``Requests(seed, ids).targets(n)``: request targets (path + query), deterministic per seed;
    ``ids`` are incident ids known to be stored (whole, as prefixes, mangled)."""

    def __init__(self, seed: int, ids: list[str]) -> None:
        self.rng, self.ids = random.Random(seed), ids or ["0" * 32]

    def _id(self) -> str:
        i = self.rng.choice(self.ids)
        return self.rng.choice((i, i[:self.rng.randint(0, 8)], i.upper(), i + "x", quote(i), " " + i, i[:1],
                                self._piece() + i[:4], "%" + i))

    def _piece(self) -> str:
        return "".join(self.rng.choice(PIECES) for _ in range(self.rng.randint(1, 4)))

    def _path(self) -> str:
        r = self.rng.random()
        route = self.rng.choice(ROUTES).replace("{id}", self._id())
        if r < 0.5:
            return route
        if r < 0.8:  # a piece spliced in somewhere
            at = self.rng.randrange(len(route) + 1)
            return route[:at] + self._piece() + route[at:]
        if r < 0.9:
            return route + "/" + "a" * self.rng.choice((100, 4_000, 20_000, 70_000))  # 70,000: over the request-line limit (414)
        # (never empty or blank: "GET  HTTP/1.1" is an HTTP/0.9 request, answered without a status line)
        return self.rng.choice(("*", "http://127.0.0.1/metrics", "api/incidents", "?", "//api/incidents",
                                "/api/incidents/" + "\x00" * 3, "/%", "/api/incidents/%ff"))

    def _query(self) -> str:
        parts = []
        for _ in range(self.rng.choice((0, 1, 1, 2, 3, 8))):
            key = self.rng.choice(PARAMS)
            value = self.rng.choice(NUMBERS) if self.rng.random() < 0.7 else self._piece()
            if self.rng.random() < 0.3:
                value = quote(value, safe="")
            parts.append(self.rng.choice((f"{key}={value}", key, f"{key}=", f"={value}", f"{key}={value}={value}")))
        sep = self.rng.choice(("&", "&", ";", "&&"))
        return ("?" + sep.join(parts)) if parts or self.rng.random() < 0.1 else ""

    def targets(self, n: int) -> list[str]:
        return [self._path() + self._query() for _ in range(n)]


def raw_get(host: str, port: int, target: str, timeout: float = 10.0, accept: str | None = None) -> tuple[int, bytes]:
    """Send ``GET <target> HTTP/1.1`` with the target's bytes as they are; (status, body).
    A dropped connection or a response without a status line raises."""
    head = b"GET " + target.encode("utf-8", "surrogatepass") + b" HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n"
    if accept is not None:
        head += b"Accept: " + accept.encode("utf-8") + b"\r\n"
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(head + b"\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    response = b"".join(chunks)
    status_line = response.split(b"\r\n", 1)[0].split(b" ")
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1.") or not status_line[1].isdigit():
        raise ConnectionError(f"no HTTP response to {target[:80]!r}: {response[:80]!r}")
    return int(status_line[1]), response.split(b"\r\n\r\n", 1)[-1]
