"""A simulated replica's `/metrics` page: vLLM's names, several lora_requests_info series, the timing
histograms the engine keeps (TTFT, inter-token latency and its older name, queue and prefill time: the
plugin learns each pod's speed from them), and the other histogram families that give a real page its
size (~40 KB), so scraping costs what it costs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .engine import Histogram

if TYPE_CHECKING:
    from .server import LiveReplica

_HISTOGRAMS = {
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "vllm:request_inference_time_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4096],
    "vllm:request_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4096],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_params_max_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4096],
}


def render_sglang_metrics(replica: LiveReplica, base_model: str) -> str:
    """The same replica as SGLang reports itself: no adapter names, slots and queue under its own names."""
    engine = replica.engine
    m = engine.snapshot()
    label = f'model_name="{base_model}",tp_rank="0"'
    active = len(m.running_lora_adapters | m.waiting_lora_adapters)
    families = [
        ("sglang:num_running_reqs", "The number of running requests.", m.num_requests_running),
        ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", m.num_requests_waiting),
        ("sglang:token_usage", "The token usage.", m.kv_cache_usage),
        ("sglang:lora_pool_slots_used", "LoRA adapter slots in use.", min(active, engine.config.max_loras)),
        ("sglang:lora_pool_slots_total", "LoRA adapter slots.", engine.config.max_loras),
    ]
    lines = []
    for name, help_text, value in families:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{{{label}}} {float(value)}"]
    lines += ["# HELP sglang:cache_config_info Cache configuration.", "# TYPE sglang:cache_config_info gauge",
              f'sglang:cache_config_info{{{label},num_pages="{engine.config.kv_blocks}",'
              f'page_size="{engine.config.block_size}"}} 1.0']
    return "\n".join(lines + _connection_lines(replica)) + "\n"


def _connection_lines(replica: LiveReplica) -> list[str]:
    conn = replica.connections
    return [
        "# HELP sim_connections_accepted_total TCP connections this replica accepted (simulator only).",
        "# TYPE sim_connections_accepted_total counter",
        f"sim_connections_accepted_total {float(conn.accepted)}",
        "# HELP sim_connections_idle_closed_total Connections the server closed after its keep-alive timeout.",
        "# TYPE sim_connections_idle_closed_total counter",
        f"sim_connections_idle_closed_total {float(conn.idle_closed)}",
        "# HELP sim_connections_open TCP connections open now (simulator only).",
        "# TYPE sim_connections_open gauge",
        f"sim_connections_open {float(conn.open)}",
        "# HELP sim_requests_in_flight_peak Most inference requests in flight at once (simulator only).",
        "# TYPE sim_requests_in_flight_peak gauge",
        f"sim_requests_in_flight_peak {float(conn.peak_in_flight)}",
        "# HELP sim_lag_seconds_total Real seconds the simulated GPU lost to steps run late (simulator only).",
        "# TYPE sim_lag_seconds_total counter",
        f"sim_lag_seconds_total {replica.lag_s:.3f}",
    ]


def render_metrics(replica: LiveReplica, base_model: str) -> str:
    if replica.metrics_form == "sglang":
        return render_sglang_metrics(replica, base_model)
    engine = replica.engine
    m = engine.snapshot()
    label = f'engine="0",model_name="{base_model}"'
    finished = sum(engine.finished_by_reason.values())
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{label}}} {float(m.num_requests_running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{label}}} {float(m.num_requests_waiting)}",
        f"# HELP vllm:{replica.kv_metric_name} KV-cache usage. 1 means 100 percent usage.",
        f"# TYPE vllm:{replica.kv_metric_name} gauge",
        f"vllm:{replica.kv_metric_name}{{{label}}} {m.kv_cache_usage}",
        "# HELP vllm:lora_requests_info Running stats on lora requests.",
        "# TYPE vllm:lora_requests_info gauge",
    ]
    current = replica.lora_info_style == "current"
    for at, running, waiting in replica.lora_history or [(0.0, "", "")]:
        if current:  # vLLM after PR #26801: both lists name every active adapter
            running = waiting = ",".join(sorted(set(filter(None, f"{running},{waiting}".split(",")))))
        lines.append(f'vllm:lora_requests_info{{max_lora="{engine.config.max_loras}",'
                     f'running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"}} {at}')
    if current:
        lines += ["# HELP vllm:max_gpu_lora_adapters Maximum number of LoRA adapters in GPU slots.",
                  "# TYPE vllm:max_gpu_lora_adapters gauge",
                  f"vllm:max_gpu_lora_adapters{{{label}}} {float(engine.config.max_loras)}"]
    if replica.residency_metric:
        pinned = ',pinned="false"' if current else ""
        lines += ["# HELP vllm:lora_adapter_loaded Adapters loaded, by level.", "# TYPE vllm:lora_adapter_loaded gauge"]
        lines += [f'vllm:lora_adapter_loaded{{adapter_name="{a}",level="gpu"{pinned}}} 1.0' for a in engine.gpu]
        lines += [f'vllm:lora_adapter_loaded{{adapter_name="{a}",level="cpu"{pinned}}} 1.0' for a in engine.cpu]
    lines += [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{engine.config.block_size}",cache_dtype="auto",'
        f'enable_prefix_caching="{engine.config.prefix_caching}",gpu_memory_utilization="0.9",num_cpu_blocks="512",'
        f'num_gpu_blocks="{engine.config.kv_blocks}",num_gpu_blocks_override="None",sliding_window="None"}} 1.0',
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{label}}} {float(engine.preemptions)}",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{label}}} {float(engine.prompt_tokens_total)}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{label}}} {float(engine.generation_tokens_total)}",
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{label}}} {float(engine.prefix_queries_total)}",
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{{{label}}} {float(engine.prefix_hits_total)}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason, count in engine.finished_by_reason.items():
        lines.append(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="{base_model}"}} '
                     f"{float(count)}")
    lines += _connection_lines(replica)
    for name, histogram in (("vllm:time_to_first_token_seconds", engine.ttft),
                            ("vllm:inter_token_latency_seconds", engine.itl),
                            ("vllm:time_per_output_token_seconds", engine.itl),  # its name before vLLM 0.10
                            ("vllm:request_queue_time_seconds", engine.queue_time),
                            ("vllm:request_prefill_time_seconds", engine.prefill_time)):
        lines += _histogram_lines(name, histogram, label)
    for name, buckets in _HISTOGRAMS.items():
        lines += [f"# HELP {name} Histogram of {name.split(':')[1].replace('_', ' ')}.", f"# TYPE {name} histogram"]
        for i, le in enumerate(buckets):
            lines.append(f'{name}_bucket{{{label},le="{le}"}} {float(finished * (i + 1) // len(buckets))}')
        lines += [f'{name}_bucket{{{label},le="+Inf"}} {float(finished)}', f"{name}_count{{{label}}} {float(finished)}",
                  f"{name}_sum{{{label}}} {float(finished) * 1.5}"]
    return "\n".join(lines) + "\n"


def _histogram_lines(name: str, histogram: Histogram, label: str) -> list[str]:
    lines = [f"# HELP {name} Histogram of {name.split(':')[1].replace('_', ' ')}.", f"# TYPE {name} histogram"]
    for le, count in zip(histogram.buckets, histogram.cumulative()):
        lines.append(f'{name}_bucket{{{label},le="{le}"}} {float(count)}')
    lines += [f'{name}_bucket{{{label},le="+Inf"}} {float(histogram.count)}',
              f"{name}_count{{{label}}} {float(histogram.count)}", f"{name}_sum{{{label}}} {histogram.sum}"]
    return lines
