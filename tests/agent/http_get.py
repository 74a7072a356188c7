"""GET a URL from the agent's HTTP server in tests: (status, body), an HTTP error included."""
from __future__ import annotations

import urllib.error
import urllib.request


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
