"""Model discovery: the proxy's `/v1/models` lists what the fleet serves.

With wildcard deployments (`model_name: "*"`) LiteLLM's `/v1/models` lists nothing, while each vLLM
pod's own `/v1/models` lists its base model and LoRA adapters; chat front-ends and benchmark tools
discover models there. So the scraper reads every pod's `/v1/models` at a slow cadence and keeps the
union in Redis (`{prefix}:served_models`); each proxy reads it in its refresh round trip, and the
listing routes add the names their caller does not see yet.

Who sees which: only the names the caller may call, by LiteLLM's own checks for the caller's key
(its models, its team's models, access groups, wildcards such as `sql-*`); a master key sees all.
The host adapter supplies that check (`host/proxy_callback.py`); a caller it cannot authorize sees none.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Awaitable, Callable, Iterable

from ..telemetry.episodes import Episode

logger = logging.getLogger("lora_affinity")

LISTING_PATHS = ("/v1/models", "/models")


def served_models_key(prefix: str) -> str:
    return f"{{{prefix}}}:served_models"


def model_ids(page: str) -> list[str]:
    """The ids of an OpenAI-style `/v1/models` answer; ValueError when it is not one."""
    body = json.loads(page)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("not an OpenAI model list (no `data` list)")
    return [str(item["id"]) for item in data if isinstance(item, dict) and isinstance(item.get("id"), str)]


def decode_served(raw: bytes | str | None) -> frozenset[str]:
    if not raw:
        return frozenset()
    try:
        names = json.loads(raw)
    except ValueError:
        return frozenset()
    return frozenset(n for n in names if isinstance(n, str)) if isinstance(names, list) else frozenset()


def merge_listing(body: bytes, served: Iterable[str]) -> bytes | None:
    """The listing with the served names (already filtered to what its caller may call) it lacks, or None."""
    try:
        listing = json.loads(body)
    except ValueError:
        return None
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list) or listing.get("object") != "list":
        return None  # another shape (Anthropic's, Codex's catalog): not ours to change
    present = {item.get("id") for item in data if isinstance(item, dict)}
    missing = sorted(set(served) - present)
    if not missing:
        return None
    created = int(time.time())
    data += [{"id": name, "object": "model", "created": created, "owned_by": "lora-affinity"} for name in missing]
    return json.dumps(listing).encode()


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
Callable_ = Callable[[dict, frozenset[str]], Awaitable[Iterable[str]]]
"""(the request's ASGI scope, names) -> the names its caller may call."""


def listing_with_served(app: ASGIApp, served: Callable[[], Iterable[str]], callable_by: Callable_) -> ASGIApp:
    """Wraps the host's ASGI app: LiteLLM answers a listing (auth, filters, shapes), then the served names are added."""

    async def wrapped(scope: dict, receive, send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "GET" or scope.get("path") not in LISTING_PATHS:
            await app(scope, receive, send)
            return
        start: dict | None = None
        body = bytearray()

        async def capture(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if not message.get("more_body"):
                    await _send(send, start, bytes(body), scope, served, callable_by)
            else:
                await send(message)

        await app(scope, receive, capture)

    wrapped.__lora_affinity_listing__ = True  # type: ignore[attr-defined]
    return wrapped


_LISTING_FAILING = Episode(logger, "lora-affinity could not add the fleet's models to the listing")


async def _send(send, start: dict | None, body: bytes, scope: dict, served, callable_by: Callable_) -> None:
    merged = None
    if start is not None and start.get("status") == 200:
        try:
            names = frozenset(served())
            merged = merge_listing(body, await callable_by(scope, names)) if names else None
        except Exception as exc:  # the host's answer goes out unchanged rather than not at all
            _LISTING_FAILING.fail(f"{type(exc).__name__}: {exc}", exc_info=exc)
        else:
            _LISTING_FAILING.recover()
    if start is not None:
        if merged is not None:
            body = merged
            start = {**start, "headers": [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                     + [(b"content-length", str(len(body)).encode())]}
        await send(start)
    await send({"type": "http.response.body", "body": body, "more_body": False})


def install_listing(app: Any, served: Callable[[], Iterable[str]], callable_by: Callable_) -> bool:
    """Wrap the proxy's ASGI stack once it is built (its first request builds it); True once wrapped.

    An ASGI wrapper in front of the host's own middleware, acting only on GET of the listing paths:
    it does not depend on how the web framework stores its routes, which changes between releases.
    """
    stack = getattr(app, "middleware_stack", None)
    if stack is None:
        return False
    if not getattr(stack, "__lora_affinity_listing__", False):
        app.middleware_stack = listing_with_served(stack, served, callable_by)
    return True
