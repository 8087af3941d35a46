"""One simulated vLLM replica with multi-LoRA: the model both the live servers and fast mode run.

It follows the model in docs/simulator.md: a step is all prefill (first) or all decode; the
waiting queue is scanned first-come-first-served and a request whose adapter would be a
(max_loras + 1)-th distinct adapter of the batch is skipped and keeps its place; KV blocks run
out -> the newest running request is preempted and recomputed later; adapters live in a GPU LRU
(max_loras slots, ~15 ms to activate) and a CPU LRU (max_cpu_loras, ~1 s to load from disk).

The engine has no clock of its own: callers ask how long the next step takes (`plan_step`) and
then apply it (`finish_step`), in real time (the live server) or virtual time (fast mode).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from .kv_cache import BlockPool, ByteTokenizer, Tokenizer


@dataclass
class EngineConfig:
    max_loras: int = 4
    max_cpu_loras: int = 12
    kv_blocks: int = 700
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    activation_ms: float = 15.0
    disk_load_ms: float = 1000.0
    base_model: str = "meta-llama/Llama-2-7b-hf"
    mean_output_tokens: float = 580.0
    min_output_tokens: int = 1
    prefix_caching: bool = True
    max_model_len: int = 4096
    speed: float = 1.0
    """Relative to the reference GPU: 0.5 takes twice as long for every step (a slower or shared GPU)."""


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets for these histograms (vllm/v1/metrics/loggers.py)."""


class Histogram:
    """A cumulative histogram as Prometheus keeps one: bucket counts, a sum and a count."""

    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.sum += value * times
        self.count += times
        for i, le in enumerate(self.buckets):
            if value <= le:
                self.counts[i] += times
                break

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for n in self.counts:
            total += n
            out.append(total)
        return out


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request_id: str
    adapter: str | None
    prompt_tokens: int
    target_tokens: int
    arrival: float
    generated: int = 0
    blocks: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False
    prefilled: bool = False
    block_hashes: tuple[int, ...] = ()
    """The prompt's full blocks (kv_cache.block_hashes); empty: nothing to share."""
    held: list[int] = field(default_factory=list)
    """Cached blocks this sequence references (a subset of its `blocks`)."""
    cached_tokens: int = 0
    """Prompt tokens found cached at its last admission."""
    queried_tokens: int = 0
    hit_tokens: int = 0
    """Its share of the engine's prefix-cache counters, every admission (a preempted one is counted again)."""
    prompt_text: str | None = None
    """The prompt's text, to name the blocks of its reply when it ends (None: not cached)."""
    salt: str | None = None
    queued_at: float | None = None
    """When the engine received it (its queue time and TTFT count from here)."""

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.target_tokens


@dataclass
class StepResult:
    """What one step did, for the caller to deliver tokens and completions."""

    tokens: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)


class ReplicaEngine:
    def __init__(self, config: EngineConfig, rng: random.Random, warm_adapters: list[str] | None = None,
                 gpu_adapters: list[str] | None = None) -> None:
        self.config = config
        self.rng = rng
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.gpu: OrderedDict[str, None] = OrderedDict()
        self.cpu: OrderedDict[str, None] = OrderedDict()
        self.pool = BlockPool(config.kv_blocks, config.prefix_caching)
        self.tokenizer: Tokenizer = ByteTokenizer()
        """How the replica splits prompts into tokens and blocks (the server sets a `tokenizer.json`'s)."""
        self._planned: tuple[str, list[Sequence]] | None = None
        self.step_disk_loads: list[str] = []
        """The adapters the planned step loads from disk (a measuring tool attributes them)."""
        # Counters for /metrics.
        self.finished_by_reason = {"stop": 0, "length": 0, "abort": 0}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions = 0
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.queue_time = Histogram(REQUEST_BUCKETS)
        self.prefill_time = Histogram(REQUEST_BUCKETS)
        self._planned_s = 0.0
        for adapter in warm_adapters or []:
            _lru_put(self.cpu, adapter, config.max_cpu_loras)
        for adapter in gpu_adapters or []:
            _lru_put(self.cpu, adapter, config.max_cpu_loras)
            _lru_put(self.gpu, adapter, config.max_loras)

    def fork(self) -> ReplicaEngine:
        """A copy to look ahead with (the forward oracle, `bench/oracle.py`): the same queue, batch, planned step,
        adapters, cache and random draws; its own counters, no KV events, and no reply blocks cached (a look-ahead
        ends at first tokens, long before a reply's blocks matter)."""
        copy = ReplicaEngine(replace(self.config), random.Random())
        copy.rng.setstate(self.rng.getstate())
        planned = self._planned[1] if self._planned is not None else []
        twins = {id(s): replace(s, held=list(s.held), prompt_text=None) for s in (*self.waiting, *self.running, *planned)}
        copy.waiting = [twins[id(s)] for s in self.waiting]
        copy.running = [twins[id(s)] for s in self.running]
        copy.gpu, copy.cpu = OrderedDict(self.gpu), OrderedDict(self.cpu)
        copy.pool = self.pool.fork()
        copy.tokenizer = self.tokenizer
        if self._planned is not None:
            kind, seqs = self._planned
            copy._planned = (kind, [twins[id(s)] for s in seqs])
        copy._planned_s = self._planned_s
        return copy

    # --- requests ----------------------------------------------------------------------------
    def output_length(self, max_tokens: int) -> int:
        drawn = 1 + int(self.rng.expovariate(1.0 / self.config.mean_output_tokens))
        return max(1, min(max_tokens, max(self.config.min_output_tokens, drawn)))

    def add(self, seq: Sequence, now: float | None = None) -> None:
        seq.queued_at = seq.arrival if now is None else now
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """A client went away: the sequence leaves the batch and frees its KV blocks, like vLLM."""
        if seq.finished_at is not None or seq.aborted:
            return
        seq.aborted = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        self.finished_by_reason["abort"] += 1

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # --- stepping ----------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def _adapter_cost_ms(self, adapter: str | None, protected: set[str]) -> float:
        """Bring an adapter into a GPU slot (and from disk into CPU first if needed)."""
        if adapter is None or adapter in self.gpu:
            if adapter is not None:
                self.gpu.move_to_end(adapter)
            return 0.0
        cost = self.config.activation_ms
        if adapter not in self.cpu:
            cost += self.config.disk_load_ms
            self.step_disk_loads.append(adapter)
        _lru_put(self.cpu, adapter, self.config.max_cpu_loras)
        if len(self.gpu) >= self.config.max_loras:
            for victim in self.gpu:  # least recently used slot not serving the batch
                if victim not in protected:
                    del self.gpu[victim]
                    break
        self.gpu[adapter] = None
        return cost

    def plan_step(self) -> float:
        """Decide the next step; returns its duration in ms (0 when idle)."""
        if self.step_disk_loads:
            self.step_disk_loads = []
        admitted, cost_ms = self._admit()
        if admitted:
            tokens = sum(s.context - s.cached_tokens for s in admitted)
            self._planned = ("prefill", admitted)
            duration_ms = ((50 + 0.18 * tokens) * 1.17 + cost_ms) / self.config.speed
        elif self.running:
            self._planned = ("decode", list(self.running))
            batch = len(self.running)
            kv_tokens = sum(s.context for s in self.running)
            adapters = {s.adapter for s in self.running if s.adapter is not None}
            base = 48 + 0.35 * batch + 0.002 * kv_tokens
            duration_ms = (base * 1.17 + 0.5 * len(adapters) if adapters else base) / self.config.speed
        else:
            self._planned = None
            return 0.0
        self._planned_s = duration_ms / 1000
        return duration_ms

    def _admit(self) -> tuple[list[Sequence], float]:
        """vLLM's FCFS scan with the max_loras skip rule."""
        if not self.waiting:
            return [], 0.0
        batch_adapters = {s.adapter for s in self.running if s.adapter is not None}
        admitted: list[Sequence] = []
        tokens = 0
        cost = 0.0
        for seq in list(self.waiting):
            if len(self.running) + len(admitted) >= self.config.max_num_seqs:
                break
            if seq.adapter is not None and seq.adapter not in batch_adapters:
                if len(batch_adapters) >= self.config.max_loras:
                    continue  # skipped: keeps its place, later requests may overtake it
            hits = self.pool.cached_prefix(seq.block_hashes)
            if hits and hits * self.config.block_size >= seq.prompt_tokens:
                hits -= 1  # a fully cached prompt still recomputes its last block
            need = self._blocks_for(seq.context + 1)
            computed = seq.context - hits * self.config.block_size
            over_budget = admitted and tokens + computed > self.config.max_num_batched_tokens
            if over_budget or not self.pool.fits(seq.block_hashes[:hits], need - hits):
                break
            seq.held = self.pool.take(seq.block_hashes, hits, need - hits, self._prompt_tokens(seq), seq.adapter,
                                      self.config.block_size, seq.salt)
            seq.blocks = need
            seq.cached_tokens = hits * self.config.block_size
            self.prefix_queries_total += seq.prompt_tokens
            self.prefix_hits_total += seq.cached_tokens
            seq.queried_tokens += seq.prompt_tokens
            seq.hit_tokens += seq.cached_tokens
            tokens += computed
            if seq.adapter is not None:
                batch_adapters.add(seq.adapter)
                cost += self._adapter_cost_ms(seq.adapter, batch_adapters)
            self.waiting.remove(seq)
            admitted.append(seq)
        return admitted, cost

    @property
    def planned(self) -> tuple[str, list[Sequence]] | None:
        """The step planned and not yet finished: ("prefill", the requests it admitted) or ("decode", the batch)."""
        return self._planned

    def finish_step(self, now: float) -> StepResult:
        """Apply the planned step at time `now` (seconds, any clock)."""
        result = StepResult()
        if self._planned is None:
            return result
        kind, seqs = self._planned
        self._planned = None
        if kind == "prefill":
            for seq in seqs:
                if seq.aborted:
                    continue
                if not seq.prefilled:  # vLLM counts a request's queue and prefill once, not after a preemption
                    self.prompt_tokens_total += seq.prompt_tokens
                    self.prefill_time.observe(self._planned_s)
                    self.queue_time.observe(max(0.0, now - self._planned_s - (seq.queued_at or now)))
                seq.prefilled = True
                self.running.append(seq)
                self._emit(seq, now, result)
            return result
        emitted = len(result.tokens)
        preempted: set[int] = set()  # the batch's requests preempted by this step (the only ones it takes out)
        for seq in seqs:
            if seq.aborted or id(seq) in preempted:
                continue
            need = self._blocks_for(seq.context + 1)
            if need > seq.blocks:
                while self.pool.free < need - seq.blocks:
                    victim = self.running[-1]  # the newest running request is preempted
                    self._preempt(victim)
                    preempted.add(id(victim))
                    if victim is seq:
                        break
                if id(seq) in preempted:
                    continue
                self.pool.grow(need - seq.blocks)
                seq.blocks = need
            self._emit(seq, now, result)
        if len(result.tokens) > emitted:
            self.itl.observe(self._planned_s, len(result.tokens) - emitted)
        return result

    def _emit(self, seq: Sequence, now: float, result: StepResult) -> None:
        seq.generated += 1
        self.generation_tokens_total += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.ttft.observe(max(0.0, now - (seq.queued_at if seq.queued_at is not None else now)))
        result.tokens.append(seq)
        if seq.done:
            seq.finished_at = now
            self.running.remove(seq)
            self._free(seq, self._reply_blocks(seq))
            self.finished_by_reason["length" if seq.target_tokens >= 750 else "stop"] += 1
            result.finished.append(seq)

    def _reply_blocks(self, seq: Sequence) -> tuple[int, ...]:
        """Full blocks of the generated text after the prompt: vLLM caches them too, so a chat's next turn,
        which resends the reply, hits them (the simulator's reply is "x " per token, as it answers)."""
        if not self.config.prefix_caching or seq.prompt_text is None:
            return ()
        whole = self.tokenizer.reply_hashes(seq.prompt_text, "x " * seq.generated, seq.adapter, seq.salt,
                                            self.config.block_size)
        return whole[len(seq.block_hashes):]

    def _prompt_tokens(self, seq: Sequence):
        """The token ids of the prompt's full blocks, computed only when KV events are recorded."""
        if self.pool.events is None or seq.prompt_text is None:
            return None
        return lambda: self.tokenizer.block_tokens(seq.prompt_text, self.config.block_size)

    def _free(self, seq: Sequence, reply: tuple[int, ...] = ()) -> None:
        chain = None
        if reply and self.pool.events is not None and seq.prompt_text is not None:
            prompt, answer = seq.prompt_text, "x " * seq.generated
            chain = (tuple(seq.block_hashes) + tuple(reply),
                     lambda: self.tokenizer.block_tokens(prompt, self.config.block_size, answer), seq.adapter,
                     self.config.block_size, seq.salt)
        self.pool.release(seq.held, seq.blocks, reply, chain)
        seq.held = []
        seq.blocks = 0
        seq.cached_tokens = 0

    @property
    def free_blocks(self) -> int:
        return self.pool.free

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        self.waiting.insert(0, seq)  # recompute: back to the front of the queue
        self.preemptions += 1

    # --- observation -------------------------------------------------------------------------
    def snapshot(self):
        """The pod's state as vLLM's metrics would show it."""
        from lora_affinity_plugin.routing.podstate import PodMetrics

        return PodMetrics(
            num_requests_waiting=len(self.waiting),
            num_requests_running=len(self.running),
            kv_cache_usage=1 - self.free_blocks / self.config.kv_blocks,
            running_lora_adapters=frozenset(s.adapter for s in self.running if s.adapter),
            waiting_lora_adapters=frozenset(s.adapter for s in self.waiting if s.adapter),
            max_lora=self.config.max_loras,
            block_size=self.config.block_size,
            num_gpu_blocks=self.config.kv_blocks,
            model_names=frozenset({self.config.base_model}),
            counters=self.counters(),
        )

    def counters(self):
        """The histograms' sums and counts and the token counters, as a scraper reads them."""
        from lora_affinity_plugin.routing.podstate import PodCounters

        return PodCounters(
            prefill_time_sum=self.prefill_time.sum, prefill_time_count=self.prefill_time.count,
            queue_time_sum=self.queue_time.sum, queue_time_count=self.queue_time.count, ttft_sum=self.ttft.sum,
            ttft_count=self.ttft.count, itl_sum=self.itl.sum, itl_count=self.itl.count,
            prompt_tokens=self.prompt_tokens_total, prefix_hits=self.prefix_hits_total,
            prefix_queries=self.prefix_queries_total, generation_tokens=self.generation_tokens_total,
            requests_finished=sum(self.finished_by_reason.values()))


def _lru_put(lru: OrderedDict[str, None], key: str, capacity: int) -> None:
    lru[key] = None
    lru.move_to_end(key)
    while len(lru) > capacity:
        lru.popitem(last=False)
