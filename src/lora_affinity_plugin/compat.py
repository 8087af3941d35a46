"""What differs between the LiteLLM releases this plugin supports (the tested range is in README.md).

One place for it, so the rest of the code reads as if there were one LiteLLM.
"""

from __future__ import annotations


def aiohttp_transport_enabled() -> bool:
    """Whether LiteLLM sends upstream calls over aiohttp (its default) rather than httpx.

    Renamed from `_should_use_aiohttp_transport` (1.94-1.106) to `should_use_aiohttp_transport` (1.108).
    """
    from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

    check = getattr(AsyncHTTPHandler, "should_use_aiohttp_transport", None) or getattr(
        AsyncHTTPHandler, "_should_use_aiohttp_transport")
    return bool(check())
