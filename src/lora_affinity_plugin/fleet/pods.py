"""From LiteLLM deployments to pods: which vLLM server a deployment is, and which adapter it asks for.

Every OpenAI-compatible provider (`hosted_vllm/`, `openai/`, ...) goes through the same code path:
a pod is identified by its normalized `api_base`, whatever the provider prefix.

A deployment with an `api_base` is only a candidate pod: configs mix model servers with hosted providers
(Azure, OpenAI-compatible APIs) that have one too. The scraper reads each candidate's `/metrics`; the
plugin routes a deployment only once its page parsed as a known model server's (the record's `proven`),
or when the operator marks it (`model_info: {lora_affinity_pod: true}`; `false` keeps it out, unscraped).
The metrics token goes only to pods the operator named for it (`metrics_token_pods`).
"""

from __future__ import annotations

import fnmatch
import logging
import os
from functools import lru_cache
from typing import Any, Iterable, Mapping
from urllib.parse import urlsplit

from ..config.settings import env_reference

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
    """A deployment's value with LiteLLM's `os.environ/NAME` resolved (unset: None, as LiteLLM reads it)."""
    name = env_reference(value)
    return value if name is None else os.environ.get(name)


def deployment_pod(deployment: Mapping[str, Any]) -> str | None:
    """The pod key of a router deployment dict, or None when it has no usable api_base."""
    api_base = _resolve_env((deployment.get("litellm_params") or {}).get("api_base"))
    if not api_base:
        return None
    try:
        return normalize_api_base(api_base)
    except ValueError:
        return None


POD_MARKER = "lora_affinity_pod"
"""`model_info` key: true, the deployment is a model server pod; false, never treat it as one."""


def pod_marks(model_list: Iterable[Mapping[str, Any]]) -> dict[str, bool]:
    """pod -> the operator's `model_info.lora_affinity_pod`, for pods whose deployments set it (false wins).
    A value that is neither true nor false is said once and ignored: the deployment is judged by its page."""
    marks: dict[str, bool] = {}
    for deployment in model_list:
        raw = (deployment.get("model_info") or {}).get(POD_MARKER)
        pod = deployment_pod(deployment) if raw is not None else None
        mark = _mark(raw, pod) if pod is not None else None
        if mark is not None:
            marks[pod] = marks.get(pod, True) and mark
    return marks


_MARKS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
_BAD_MARKS_SAID: set[tuple[str, str]] = set()


def _mark(value: Any, pod: str) -> bool | None:
    if isinstance(value, bool):
        return value
    mark = _MARKS.get(str(value).strip().lower())
    if mark is None and (pod, repr(value)) not in _BAD_MARKS_SAID:
        _BAD_MARKS_SAID.add((pod, repr(value)))
        logging.getLogger("lora_affinity").warning(
            "model_info.%s of %s: %r is not allowed (true or false); ignored", POD_MARKER, pod, value)
    return mark


def discover_pods(model_list: Iterable[Mapping[str, Any]], marks: Mapping[str, bool] | None = None) -> list[str]:
    """Every distinct candidate pod named by a config's `model_list`, in order of first appearance: each
    deployment with an api_base, unless marked `lora_affinity_pod: false` (`marks`: `pod_marks`, if known)."""
    model_list = list(model_list)
    marks = pod_marks(model_list) if marks is None else marks
    seen: dict[str, None] = {}
    for deployment in model_list:
        pod = deployment_pod(deployment)
        if pod and marks.get(pod, True):
            seen.setdefault(pod)
    return list(seen)


def token_pods(candidates: Iterable[str], marks: Mapping[str, bool], host_patterns: Iterable[str]) -> frozenset[str]:
    """Of the `candidates` (`discover_pods`), those that may receive the metrics token: marked
    `lora_affinity_pod: true`, or whose `host:port` matches one of `host_patterns` (shell wildcards,
    case-insensitive). Every other api_base never sees it."""
    patterns = [p.strip().lower() for p in host_patterns if p.strip()]
    return frozenset(pod for pod in candidates if marks.get(pod) or any(
        fnmatch.fnmatchcase(urlsplit(pod).netloc, pattern) for pattern in patterns))


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
