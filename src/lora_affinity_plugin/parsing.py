"""Reading a vLLM `/metrics` page into one pod's `PodMetrics`.

A full Prometheus parse of a 48 KB page costs milliseconds; the rules need six metric families.
So we look only at lines that start with those names and parse their labels by hand.
"""

from __future__ import annotations

import math
import re

from .scheduling import PodMetrics

_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_KV_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_LORA_INFO = "vllm:lora_requests_info"
_CACHE_CONFIG = "vllm:cache_config_info"
_LORA_LOADED = "vllm:lora_adapter_loaded"
_MAX_GPU_LORAS = "vllm:max_gpu_lora_adapters"
_WANTED = (_WAITING, _RUNNING, *_KV_NAMES, _LORA_INFO, _CACHE_CONFIG, _LORA_LOADED, _MAX_GPU_LORAS)

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_MAX_QUEUE = 10_000_000


class MetricsPageError(ValueError):
    """The page cannot describe a pod; the message says which metric and why."""


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value)


def _split_sample(line: str) -> tuple[str, dict[str, str], float]:
    """`name{labels} value [timestamp]` -> (name, labels, value)."""
    brace = line.find("{")
    if brace == -1:
        name, _, rest = line.partition(" ")
        labels: dict[str, str] = {}
    else:
        close = line.rfind("}")
        if close < brace:
            raise MetricsPageError(f"{line[:brace]}: unterminated label set")
        name = line[:brace]
        labels = {k: _unescape(v) for k, v in _LABEL.findall(line, brace + 1, close)}
        rest = line[close + 1 :]
    fields = rest.split()
    if not fields:
        raise MetricsPageError(f"{name}: sample has no value")
    try:
        value = float(fields[0])
    except ValueError:
        raise MetricsPageError(f"{name}: value {fields[0][:40]!r} is not a number") from None
    return name.strip(), labels, value


def _engine(labels: dict[str, str]) -> tuple[str, str]:
    return labels.get("engine", ""), labels.get("model_name", "")


def _adapters(raw: str) -> frozenset[str]:
    return frozenset(a.strip() for a in raw.split(",") if a.strip())


def _count(name: str, value: float) -> int:
    if not math.isfinite(value) or value < 0 or value > _MAX_QUEUE:
        raise MetricsPageError(f"{name}: {value!r} is not a request count (0..{_MAX_QUEUE})")
    return int(value)


def _int_label(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key, "")
    try:
        value = int(float(raw))
    except (ValueError, OverflowError):
        return None
    return value if value >= 0 else None


def parse_metrics(text: str) -> PodMetrics:
    """Parse one pod's vLLM `/metrics` page.

    Older and current vLLM alike: GPU slots from `lora_requests_info{max_lora}` or
    `vllm:max_gpu_lora_adapters`, residency from `vllm:lora_adapter_loaded` (GPU level, or pinned).
    Several engines (`engine="0"`, `engine="1"`) or model names on one page fold into one record:
    queues summed, KV-cache usage the mean. `lora_requests_info` holds one series per state change;
    its value is a timestamp and the largest one is the current state.
    Raises MetricsPageError when the page has no queue metrics or a needed value is invalid.
    """
    waiting: dict[tuple[str, str], int] = {}
    running: dict[tuple[str, str], int] = {}
    kv: dict[tuple[str, str], float] = {}
    lora_latest: tuple[float, dict[str, str]] | None = None
    loaded: set[str] = set()
    model_names: set[str] = set()
    block_size = num_gpu_blocks = max_gpu_loras = None

    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        name, labels, value = _split_sample(line)
        if "model_name" in labels and name in (_WAITING, _RUNNING):
            model_names.add(labels["model_name"])
        if name == _WAITING:
            waiting[_engine(labels)] = _count(name, value)
        elif name == _RUNNING:
            running[_engine(labels)] = _count(name, value)
        elif name in _KV_NAMES:
            if not math.isfinite(value) or not 0.0 <= value <= 1.0:
                raise MetricsPageError(f"{name}: {value!r} is outside 0..1")
            kv.setdefault(_engine(labels), value)  # the newer name comes first on pages with both
        elif name == _LORA_INFO:
            if math.isfinite(value) and (lora_latest is None or value > lora_latest[0]):
                lora_latest = (value, labels)
        elif name == _CACHE_CONFIG:
            block_size = _int_label(labels, "block_size")
            num_gpu_blocks = _int_label(labels, "num_gpu_blocks")
        elif name == _LORA_LOADED:
            # In a GPU slot, or pinned (vLLM keeps a pinned adapter loaded whatever the LRU says).
            resident = labels.get("level", "gpu") == "gpu" or labels.get("pinned", "").lower() == "true"
            if resident and value > 0 and labels.get("adapter_name"):
                loaded.add(labels["adapter_name"])
        elif name == _MAX_GPU_LORAS:
            if math.isfinite(value) and 0 <= value <= 1024:
                max_gpu_loras = int(value)

    if not running and not waiting:
        raise MetricsPageError(f"not a vLLM metrics page: neither {_RUNNING} nor {_WAITING} found")

    lora = lora_latest[1] if lora_latest else {}
    # Since vLLM PR #26801 both adapter lists name every active adapter; running | waiting stays right.
    max_lora = _int_label(lora, "max_lora")
    return PodMetrics(
        num_requests_waiting=sum(waiting.values()),
        num_requests_running=sum(running.values()),
        kv_cache_usage=sum(kv.values()) / len(kv) if kv else 0.0,
        # The first proposal of the metric named these labels running_adapters / waiting_adapters.
        running_lora_adapters=_adapters(lora.get("running_lora_adapters", lora.get("running_adapters", ""))),
        waiting_lora_adapters=_adapters(lora.get("waiting_lora_adapters", lora.get("waiting_adapters", ""))),
        max_lora=max_lora if max_lora is not None else max_gpu_loras,
        loaded_lora_adapters=frozenset(loaded),
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        model_names=frozenset(model_names),
    )
