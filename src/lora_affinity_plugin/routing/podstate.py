"""What the rules read about a pod: its scraped metrics, its cumulative counters and its learned speeds.

The bottom of the house: parsing writes these, the store carries them through Redis, `rates.py` learns
`PodRates` from `PodCounters`, and the rules (`decision.py`, `cost.py` and the parts) read them. It imports nothing of
the plugin's own, so every layer above can use it without a circle.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_OVERHEAD_S = 0.05
"""A prefill step's fixed cost at speed 1 (scheduling, sampling, the first token's decode)."""
PREFILL_S_PER_TOKEN = 0.0002
"""Prefill seconds per prompt token at speed 1 (a 7B model on one A100-class GPU: ~5k tokens/s)."""
DECODE_STEP_S = 0.06
"""A decode step (the time per output token) when nothing has been learned yet."""
MEAN_OUTPUT_TOKENS = 200.0
"""Output tokens per request when the pod has not finished enough requests to say."""


@dataclass(frozen=True, slots=True)
class PodCounters:
    """Cumulative sums and counts from one page (`parsing.parse_metrics`); deltas make the rates."""

    prefill_time_sum: float = 0.0
    prefill_time_count: float = 0.0
    queue_time_sum: float = 0.0
    queue_time_count: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    prompt_tokens: float = 0.0
    prefix_hits: float = 0.0
    """Prompt tokens found in the prefix cache (not computed)."""
    prefix_queries: float = 0.0
    """Prompt tokens looked up in the prefix cache: counted with the hits, when a request is scheduled."""
    generation_tokens: float = 0.0
    requests_finished: float = 0.0


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """One pod's scraped state, named after vLLM's metrics."""

    num_requests_waiting: int = 0
    num_requests_running: int = 0
    kv_cache_usage: float = 0.0
    running_lora_adapters: frozenset[str] = frozenset()
    waiting_lora_adapters: frozenset[str] = frozenset()
    max_lora: int | None = None
    loaded_lora_adapters: frozenset[str] = frozenset()
    """Adapters in GPU slots, from `vllm:lora_adapter_loaded{level="gpu"}` when a server exposes it."""
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    model_names: frozenset[str] = frozenset()
    """Base models the server reports (`model_name` labels): a request for one of them uses no adapter."""
    engine: str = "vllm"
    """The model server whose metric names the page used (`engines.ENGINES`)."""
    counters: PodCounters | None = None
    """Histogram sums and counts, token counters: the scraper learns the pod's rates from their deltas."""


RATE_BOUNDS: dict[str, tuple[float, float]] = {
    "prefill_factor": (0.05, 100.0),
    "decode_step_s": (1e-4, 10.0),
    "queue_s_per_request": (1e-4, 60.0),
    "mean_output_tokens": (1.0, 1e6),
    "decode_factor": (0.01, 100.0),
}
"""What a learned rate may be: a pod's noise, or a record from a faulty scraper, cannot push a rate past these."""


@dataclass(frozen=True, slots=True)
class PodRates:
    """A pod's speeds: what `rates.RateTracker` learned from its histograms, or the defaults."""

    prefill_factor: float = 1.0
    """Measured prefill time over what the defaults predict for the same requests: 2.0 is half speed."""
    decode_step_s: float = DECODE_STEP_S
    """Mean time per output token over the last scrapes (vLLM's inter-token latency)."""
    queue_s_per_request: float = DECODE_STEP_S
    """Seconds each waiting request held the ones behind it (mean queue time over mean queue length)."""
    mean_output_tokens: float = MEAN_OUTPUT_TOKENS
    learned: bool = False
    """Whether any of these came from the pod (False: all defaults)."""
    decode_factor: float = 1.0
    """Measured decode steps over what the defaults predict at the batch and KV the pod ran
    (`cost.expected_step_s`): unlike the step itself it does not grow with the load, so pods compare by it."""

    @classmethod
    def bounded(cls, learned: bool, **rates: float) -> PodRates:
        """Rates held within `RATE_BOUNDS` (a NaN takes the default)."""
        defaults = DEFAULT_RATES
        values = {}
        for name, value in rates.items():
            low, high = RATE_BOUNDS[name]
            values[name] = min(max(value, low), high) if value == value else getattr(defaults, name)
        return cls(learned=learned, **values)

    def prefill_s(self, tokens: float) -> float:
        return self.prefill_factor * (PREFILL_OVERHEAD_S + PREFILL_S_PER_TOKEN * (tokens if tokens > 0.0 else 0.0))

    def to_dict(self) -> dict[str, float | bool]:
        return {"prefill_factor": round(self.prefill_factor, 4), "decode_step_s": round(self.decode_step_s, 5),
                "queue_s_per_request": round(self.queue_s_per_request, 5),
                "mean_output_tokens": round(self.mean_output_tokens, 1), "learned": self.learned,
                "decode_factor": round(self.decode_factor, 4)}


DEFAULT_RATES = PodRates()
