"""Model servers' metric names: which family on a `/metrics` page means queue, running, KV use, slots.

The rules speak vLLM (PodMetrics); a profile maps another server's names onto them. Where a server
names no adapters, the fleet's residency memory (what this plugin sent there) stands in.
Names: each server's own metrics documentation (vLLM's `vllm:` families, SGLang's `sglang:`, trtllm-serve's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping

EngineName = Literal["vllm", "sglang", "trtllm"]


@dataclass(frozen=True)
class EngineProfile:
    name: str
    title: str
    waiting: str
    running: str
    kv_usage: tuple[str, ...]
    """KV-cache use in 0..1; the first name found wins."""
    cache_config: str | None = None
    """An info metric whose labels give the block size and block count."""
    block_size_label: str = "block_size"
    num_blocks_label: str = "num_gpu_blocks"
    block_size_metric: str | None = None
    """Or plain gauges for them (trtllm-serve)."""
    num_blocks_metric: str | None = None
    lora_slots: str | None = None
    """A gauge of GPU adapter slots, when the server has one."""
    adapter_names: bool = False
    """Whether the page names the adapters running and loaded (vLLM's lora_requests_info, lora_adapter_loaded)."""

    @property
    def families(self) -> tuple[str, ...]:
        names = (self.waiting, self.running, *self.kv_usage, self.cache_config, self.block_size_metric,
                 self.num_blocks_metric, self.lora_slots)
        return tuple(n for n in names if n)


ENGINES: dict[str, EngineProfile] = {
    "vllm": EngineProfile(
        "vllm", "vLLM", "vllm:num_requests_waiting", "vllm:num_requests_running",
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), cache_config="vllm:cache_config_info",
        lora_slots="vllm:max_gpu_lora_adapters", adapter_names=True),
    "sglang": EngineProfile(
        "sglang", "SGLang", "sglang:num_queue_reqs", "sglang:num_running_reqs", ("sglang:token_usage",),
        cache_config="sglang:cache_config_info", block_size_label="page_size", num_blocks_label="num_pages",
        lora_slots="sglang:lora_pool_slots_total"),
    "trtllm": EngineProfile(
        "trtllm", "trtllm-serve", "trtllm_num_requests_waiting", "trtllm_num_requests_running", ("trtllm_kv_cache_utilization",),
        block_size_metric="trtllm_kv_cache_tokens_per_block", num_blocks_metric="trtllm_kv_cache_max_blocks"),
}

ENGINE_INFO_KEY = "engine"
"""`model_info` key naming a deployment's model server."""


def pod_engines(model_list: Iterable[Mapping[str, Any]], default: str) -> dict[str, str]:
    """pod -> engine name: a deployment's `model_info.engine`, else `default` (the first one named wins)."""
    from ..fleet.pods import deployment_pod

    engines: dict[str, str] = {}
    for deployment in model_list:
        pod = deployment_pod(deployment)
        if pod is None:
            continue
        named = (deployment.get("model_info") or {}).get(ENGINE_INFO_KEY)
        if pod not in engines or (named and engines[pod] == default):
            engines[pod] = str(named) if named else default
    unknown = sorted({e for e in engines.values() if e not in ENGINES})
    if unknown:
        raise ValueError(f"model_info.{ENGINE_INFO_KEY}: {unknown[0]!r} is not one of {', '.join(ENGINES)}")
    return engines
