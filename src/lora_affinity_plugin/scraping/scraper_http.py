"""The scraper worker's HTTP port: `/metrics` (Prometheus), `/healthz` (the process answers) and `/readyz`
(it is doing its job), 404 for anything else, so that a probe proves what it names.

`/readyz` answers 200 while the worker reached Redis within the last `READY_INTERVALS` scrape intervals (or its
lease period, if longer) and, when it leads, wrote its pods' records within that time; a standby that reaches
Redis is ready (it takes over when the leader stops). Its JSON body says which, and how old the last write is.
The server runs in a daemon thread beside the worker's event loop and only reads the worker's attributes.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

if TYPE_CHECKING:
    from .worker import Scraper

READY_INTERVALS = 5
"""How many scrape intervals without reaching Redis (or writing, as leader) make the worker not ready."""


def readiness(scraper: Scraper, now: float | None = None) -> tuple[bool, dict]:
    """Whether `scraper` is ready, and why (the `/readyz` body)."""
    now = time.monotonic() if now is None else now
    settings = scraper.settings
    window = max(READY_INTERVALS * settings.scrape_interval_ms, settings.scraper_lease_ms) / 1000
    redis_age = None if scraper.redis_ok_at is None else now - scraper.redis_ok_at
    write_age = None if scraper.written_at is None else now - scraper.written_at
    reached = redis_age is not None and redis_age <= window
    role = "leader" if scraper.leader else "standby"
    ready = reached and (role == "standby" or (write_age is not None and write_age <= window))
    return ready, {"ready": ready, "role": role, "redis_reached_s_ago": _round(redis_age),
                   "records_written_s_ago": _round(write_age), "window_s": window}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def serve(scraper: Scraper, port: int, host: str = "") -> ThreadingHTTPServer:
    """Serve the worker's port in a daemon thread; returns the server (`shutdown()` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            if path == "/metrics":
                self._send(200, generate_latest(), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif path == "/readyz":
                ready, body = readiness(scraper)
                self._send(200 if ready else 503, json.dumps(body).encode() + b"\n", "application/json")
            else:
                self._send(404, b"not found: /metrics, /healthz and /readyz are served here\n", "text/plain")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # a probe every few seconds: no access log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="scraper-http", daemon=True).start()
    return server
