"""Reading a model server's `/metrics` page into one pod's `PodMetrics` (vLLM's, or another's profile).

A full Prometheus parse of a 48 KB page costs milliseconds; the rules need six metric families.
So we look only at lines that start with those names and parse their labels by hand.
"""

from __future__ import annotations

import math
import re

from ..routing.podstate import PodCounters, PodMetrics
from .engines import ENGINES, EngineProfile

_LORA_INFO = "vllm:lora_requests_info"
_LORA_LOADED = "vllm:lora_adapter_loaded"
_COUNTERS = {
    "vllm:request_prefill_time_seconds_sum": "prefill_time_sum",
    "vllm:request_prefill_time_seconds_count": "prefill_time_count",
    "vllm:request_queue_time_seconds_sum": "queue_time_sum",
    "vllm:request_queue_time_seconds_count": "queue_time_count",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "vllm:time_per_output_token_seconds_sum": "itl_sum",  # the name before vLLM 0.10
    "vllm:time_per_output_token_seconds_count": "itl_count",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits",  # the name before vLLM 0.10
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:request_success_total": "requests_finished",
}
"""vLLM's histogram sums and counts and token counters (`routing/rates.py` learns each pod's speeds from them)."""
_WANTED = {name: (*p.families, *((_LORA_INFO, _LORA_LOADED, *_COUNTERS) if p.adapter_names else ()))
           for name, p in ENGINES.items()}

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_MAX_QUEUE = 10_000_000
# Upper bounds for the numbers that size things: a page beyond them is refused (that pod marked bad).
_MAX_BLOCK_SIZE = 1 << 16  # tokens per KV block (vLLM: 16-256)
_MAX_GPU_BLOCKS = 1 << 31  # KV blocks per pod
_MAX_LORA = 1024  # GPU adapter slots
_MAX_PROBLEMS = 16  # a page's problems described, at most


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


def _int_label(labels: dict[str, str], key: str, limit: int) -> int | None:
    """A non-negative integer label; None when absent or not a number; MetricsPageError above `limit`."""
    raw = labels.get(key, "")
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value) or value < 0:
        return None
    if value > limit:
        raise MetricsPageError(f"{key}: {raw!r} is larger than {limit}")
    return int(value)


def parse_metrics(text: str, engine: str = "vllm", problems: list[str] | None = None) -> PodMetrics:
    """Parse one pod's `/metrics` page, written by `engine` (a name in `engines.ENGINES`).

    Older and current vLLM alike: GPU slots from `lora_requests_info{max_lora}` or
    `vllm:max_gpu_lora_adapters`, residency from `vllm:lora_adapter_loaded` (GPU level, or pinned).
    Several engines (`engine="0"`, `engine="1"`) or model names on one page fold into one record:
    queues summed, KV-cache usage the mean. `lora_requests_info` holds one series per state change;
    its value is a timestamp and the largest one is the current state.
    Raises MetricsPageError when the page has no queue metrics or a needed value is invalid.

    With a `problems` list, a page that parses in part still describes its pod: a bad sample outside the
    queue families is skipped (its figure keeps its default) and described in `problems`; only a bad or
    missing queue figure raises (a pod's queue is the one number no rule can do without).
    """
    profile: EngineProfile = ENGINES[engine]
    wanted = _WANTED[engine]
    waiting: dict[tuple[str, str], int] = {}
    running: dict[tuple[str, str], int] = {}
    kv: dict[str, dict[tuple[str, str], float]] = {}
    lora_latest: tuple[float, dict[str, str]] | None = None
    loaded: set[str] = set()
    model_names: set[str] = set()
    block_size = num_gpu_blocks = lora_slots = None
    counters: dict[str, float] = {}

    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        try:
            name, labels, value = _split_sample(line)
            if "model_name" in labels and name in (profile.waiting, profile.running):
                model_names.add(labels["model_name"])
            if name == profile.waiting:
                waiting[_engine(labels)] = _count(name, value)
            elif name == profile.running:
                running[_engine(labels)] = _count(name, value)
            elif name in profile.kv_usage:
                if not math.isfinite(value) or not 0.0 <= value <= 1.0:
                    raise MetricsPageError(f"{name}: {value!r} is outside 0..1")
                kv.setdefault(name, {})[_engine(labels)] = value
            elif name == _LORA_INFO:
                if math.isfinite(value) and (lora_latest is None or value > lora_latest[0]):
                    lora_latest = (value, labels)
            elif name == profile.cache_config:
                block_size = _int_label(labels, profile.block_size_label, _MAX_BLOCK_SIZE)
                num_gpu_blocks = _int_label(labels, profile.num_blocks_label, _MAX_GPU_BLOCKS)
            elif name == profile.block_size_metric:
                block_size = _gauge_int(name, value, _MAX_BLOCK_SIZE)
            elif name == profile.num_blocks_metric:
                num_gpu_blocks = _gauge_int(name, value, _MAX_GPU_BLOCKS)
            elif name == _LORA_LOADED:
                # In a GPU slot, or pinned (vLLM keeps a pinned adapter loaded whatever the LRU says).
                resident = labels.get("level", "gpu") == "gpu" or labels.get("pinned", "").lower() == "true"
                if resident and value > 0 and labels.get("adapter_name"):
                    loaded.add(labels["adapter_name"])
            elif name == profile.lora_slots:
                if math.isfinite(value) and 0 <= value <= 1024:
                    lora_slots = int(value)
            elif name in _COUNTERS:
                if math.isfinite(value) and value >= 0:  # a bad counter costs its rate, not the pod
                    field = _COUNTERS[name]
                    counters[field] = counters.get(field, 0.0) + value
        except MetricsPageError as exc:
            if problems is None or line.startswith((profile.waiting, profile.running)):
                raise
            if len(problems) < _MAX_PROBLEMS:
                problems.append(str(exc)[:200])

    if not running and not waiting:
        raise MetricsPageError(f"not a {profile.title} metrics page: neither {profile.running} nor {profile.waiting} found")

    lora = lora_latest[1] if lora_latest else {}
    # Since vLLM PR #26801 both adapter lists name every active adapter; running | waiting stays right.
    try:
        max_lora = _int_label(lora, "max_lora", _MAX_LORA)
    except MetricsPageError as exc:
        if problems is None:
            raise
        problems.append(f"{_LORA_INFO}: {exc}"[:200])
        max_lora = None
    kv_values = next((kv[n] for n in profile.kv_usage if n in kv), {})  # the newer name, when a page has both
    return PodMetrics(
        num_requests_waiting=sum(waiting.values()),
        num_requests_running=sum(running.values()),
        kv_cache_usage=sum(kv_values.values()) / len(kv_values) if kv_values else 0.0,
        # The first proposal of the metric named these labels running_adapters / waiting_adapters.
        running_lora_adapters=_adapters(lora.get("running_lora_adapters", lora.get("running_adapters", ""))),
        waiting_lora_adapters=_adapters(lora.get("waiting_lora_adapters", lora.get("waiting_adapters", ""))),
        max_lora=max_lora if max_lora is not None else lora_slots,
        loaded_lora_adapters=frozenset(loaded),
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        model_names=frozenset(model_names),
        engine=engine,
        counters=PodCounters(**counters) if counters else None,
    )


def _gauge_int(name: str, value: float, limit: int) -> int | None:
    if not math.isfinite(value) or value < 0:
        return None
    if value > limit:
        raise MetricsPageError(f"{name}: {value!r} is larger than {limit}")
    return int(value)
