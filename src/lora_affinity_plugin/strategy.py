"""The entry point `config.yaml` names: the routing strategy and the callback that installs it.

Proxy users list one line in `config.yaml`:
    litellm_settings:
      callbacks: ["lora_affinity_plugin.strategy.proxy_plugin"]
Python users call `install(router, settings)`. The strategy lives in `host/host_strategy.py`, the callback in
`host/proxy_callback.py` (imported only when asked for: a Python user's router needs no proxy callback).
"""

from __future__ import annotations

from typing import Any

from .host.host_strategy import LoraAffinityStrategy, install, installed_strategy

__all__ = ["LoraAffinityStrategy", "install", "installed_strategy"]  # (and proxy_plugin, on request)


def __getattr__(name: str) -> Any:
    """`lora_affinity_plugin.strategy.proxy_plugin`, the callback line users have, resolves to the proxy callback."""
    if name in ("proxy_plugin", "ProxyPlugin"):
        from .host import proxy_callback

        return getattr(proxy_callback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
