"""A local aiohttp server with one scripted `/metrics` page per pod name, for scraper unit tests.

A page is text or bytes (served as is), an int (that HTTP status), or "hang" (never answers in time).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from aiohttp import web

REFUSED = "http://127.0.0.1:1"
"""A pod URL nothing listens on."""


@asynccontextmanager
async def serve_pages(pages: dict[str, object], seen: list | None = None) -> AsyncIterator[Callable[[str], str]]:
    """Yields `url(name)`: the pod URL whose `/metrics` serves `pages[name]` (read at each request, so a test
    may change it). `seen` collects (pod name, Authorization header or None) per request."""

    async def handler(request: web.Request) -> web.Response:
        if seen is not None:
            seen.append((request.match_info["pod"], request.headers.get("Authorization")))
        page = pages[request.match_info["pod"]]
        if isinstance(page, int):
            return web.Response(status=page)
        if page == "hang":
            await asyncio.sleep(10)
        return web.Response(body=page if isinstance(page, bytes) else page.encode())

    app = web.Application()
    app.router.add_get("/{pod}/metrics", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # a "hang" handler is cancelled, not awaited
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield lambda name: f"http://127.0.0.1:{port}/{name}"
    finally:
        await runner.cleanup()
