"""From LiteLLM deployments to pods: which vLLM server a deployment is, and which adapter it asks for.

Every OpenAI-compatible provider (`hosted_vllm/`, `openai/`, ...) goes through the same code path:
a pod is identified by its normalized `api_base`, whatever the provider prefix.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Iterable, Mapping
from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


@lru_cache(maxsize=4096)
def normalize_api_base(api_base: str) -> str:
    """`HTTP://Pod-A:8000/v1/` -> `http://pod-a:8000`: one key per server however it is spelled."""
    parts = urlsplit(api_base.strip())
    scheme = (parts.scheme or "http").lower()
    host = (parts.hostname or "").lower()
    if not host:
        raise ValueError(f"api_base {api_base!r} has no host")
    port = parts.port or _DEFAULT_PORTS.get(scheme, 80)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{scheme}://{host}:{port}{path}"


def _resolve_env(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("os.environ/"):
        return os.environ.get(value.removeprefix("os.environ/"))
    return value


def deployment_pod(deployment: Mapping[str, Any]) -> str | None:
    """The pod key of a router deployment dict, or None when it has no usable api_base."""
    api_base = _resolve_env((deployment.get("litellm_params") or {}).get("api_base"))
    if not api_base:
        return None
    try:
        return normalize_api_base(api_base)
    except ValueError:
        return None


def discover_pods(model_list: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every distinct pod named by a config's `model_list`, in order of first appearance."""
    seen: dict[str, None] = {}
    for deployment in model_list:
        pod = deployment_pod(deployment)
        if pod:
            seen.setdefault(pod)
    return list(seen)


def _provider_prefixes() -> frozenset[str]:
    try:
        import litellm

        return frozenset(str(getattr(p, "value", p)) for p in litellm.provider_list)
    except Exception:  # pragma: no cover - litellm is a dependency; keep the helper usable without it
        return frozenset({"hosted_vllm", "openai", "vllm", "text-completion-openai"})


_PROVIDERS: frozenset[str] | None = None


def strip_provider(model: str) -> str:
    """`hosted_vllm/sql-lora` -> `sql-lora`; `meta-llama/Llama-2-7b-hf` stays as it is."""
    global _PROVIDERS
    if _PROVIDERS is None:
        _PROVIDERS = _provider_prefixes()
    head, sep, tail = model.partition("/")
    return tail if sep and head in _PROVIDERS else model


def is_wildcard(deployment: Mapping[str, Any]) -> bool:
    model = str((deployment.get("litellm_params") or {}).get("model", ""))
    return "*" in str(deployment.get("model_name", "")) or model.endswith("*")


def deployment_adapter(deployment: Mapping[str, Any], requested_model: str, info_key: str) -> str:
    """The model name the request will carry to vLLM: the adapter when it is a LoRA.

    Order: an explicit `model_info[info_key]`, the requested name for wildcard deployments,
    else the deployment's model without its provider prefix.
    """
    info = deployment.get("model_info") or {}
    explicit = info.get(info_key)
    if explicit:
        return str(explicit)
    if is_wildcard(deployment):
        return requested_model
    return strip_provider(str((deployment.get("litellm_params") or {}).get("model", requested_model)))
