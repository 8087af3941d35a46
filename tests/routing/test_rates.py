"""Each pod's speeds, learned from its histograms; the cost they feed; a slow pod gets less."""

import random

import pytest

from lora_affinity_plugin.routing.podstate import DEFAULT_RATES, PodRates
from lora_affinity_plugin.scraping.parsing import parse_metrics
from lora_affinity_plugin.routing.rates import RateTracker, decode_load
from lora_affinity_plugin.routing.podstate import PodCounters
from lora_affinity_plugin.routing.scheduling import Candidate, RouteRequest, choose_pod
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_lab.sim.engine import EngineConfig, ReplicaEngine, Sequence
from lora_affinity_plugin.fleet.store import PodRecord
import paths

S = build_settings({"rule_set": "lora-affinity-tree"}, environ={})
FIXTURES = paths.FIXTURES / "vllm-metrics"  # real pages (see its README.txt)


def _drive(speed: float, seconds: float = 30.0, scrape_s: float = 0.2, concurrency: int = 20) -> PodRates:
    """A replica at `speed` with `concurrency` requests on it, scraped every `scrape_s` into a tracker."""
    engine = ReplicaEngine(EngineConfig(speed=speed, mean_output_tokens=50), random.Random(3))
    tracker, rates, now, next_scrape, n = RateTracker(), DEFAULT_RATES, 0.0, 0.0, 0
    while now < seconds:
        if len(engine.waiting) + len(engine.running) < concurrency:
            engine.add(Sequence(str(n), "sql-lora", 300, engine.output_length(100), now), now)
            n += 1
        duration = engine.plan_step() / 1000 or 0.01
        now += duration
        engine.finish_step(now)
        if now >= next_scrape:
            page = engine.snapshot()
            rates = tracker.observe("pod", page.counters, now, *decode_load(page))
            next_scrape = now + scrape_s
    return rates


def test_a_half_speed_replica_is_learned_as_half_speed():
    fast, slow = _drive(1.0), _drive(0.5)
    assert fast.learned and slow.learned
    assert 1.7 < slow.decode_step_s / fast.decode_step_s < 2.3
    assert 1.7 < slow.decode_factor / fast.decode_factor < 2.3
    assert 1.6 < slow.prefill_factor / fast.prefill_factor < 2.5
    assert 30 < fast.mean_output_tokens < 80  # drawn around 50


def test_a_lone_request_s_steps_are_learned_and_a_bigger_batch_is_not_slowness():
    # One request at a time makes ~4 tokens per scrape: intervals are pooled until they say enough.
    alone_fast, alone_slow = _drive(1.0, concurrency=1), _drive(0.5, concurrency=1)
    assert 1.7 < alone_slow.decode_factor / alone_fast.decode_factor < 2.3
    # A full batch's steps are longer (more KV to read each step): its decode factor stays the pod's speed.
    full = _drive(1.0, concurrency=48)
    assert full.decode_step_s / alone_fast.decode_step_s > 1.4
    assert 0.8 < full.decode_factor / alone_fast.decode_factor < 1.25


def test_rates_start_at_the_defaults_and_restart_with_the_server():
    tracker = RateTracker()
    assert tracker.observe("pod", PodCounters(), 0.0) is DEFAULT_RATES
    busy = PodCounters(prefill_time_sum=2.0, prefill_time_count=10, prompt_tokens=3000, itl_sum=3.0, itl_count=30)
    learned = tracker.observe("pod", busy, 1.0)
    assert learned.learned and learned.decode_step_s == pytest.approx(0.1)
    assert tracker.observe("pod", PodCounters(prefill_time_count=1), 2.0) is DEFAULT_RATES  # counters went back
    assert tracker.observe("pod", None, 3.0) is DEFAULT_RATES  # a page without histograms keeps what it had


def test_each_rate_s_first_measurement_stands_alone_whichever_came_first():
    """A half-speed pod's first prefill came in a scrape before it had made 20 output tokens: its first decode
    figure must read 2x, not 1.5x (averaged with the default), or the pod does not count as slow for seconds."""
    tracker = RateTracker()
    tracker.observe("pod", PodCounters(), 0.0)
    prefilled = PodCounters(prefill_time_sum=0.2, prefill_time_count=1, prompt_tokens=250)  # 2x the 0.1 s expected
    first = tracker.observe("pod", prefilled, 0.2)
    assert first.learned and first.prefill_factor == pytest.approx(2.0) and first.decode_factor == 1.0
    step = 2 * 0.06  # twice what the defaults predict for a lone request with no KV
    decoded = PodCounters(prefill_time_sum=0.2, prefill_time_count=1, prompt_tokens=250, itl_sum=20 * step, itl_count=20)
    second = tracker.observe("pod", decoded, 0.4)
    assert second.decode_factor == pytest.approx(2.0) and second.decode_step_s == pytest.approx(step)
    assert second.prefill_factor == pytest.approx(2.0)  # unchanged: no prefill in that interval
    again = PodCounters(prefill_time_sum=0.3, prefill_time_count=2, prompt_tokens=500, itl_sum=40 * step, itl_count=40)
    assert tracker.observe("pod", again, 0.6).prefill_factor == pytest.approx(1.5)  # from then on, averaged


def test_after_a_restart_each_rate_s_first_measurement_stands_alone_again():
    tracker = RateTracker()
    tracker.observe("pod", PodCounters(), 0.0)
    tracker.observe("pod", PodCounters(prefill_time_sum=0.2, prefill_time_count=1, prompt_tokens=250), 0.2)  # 2x
    restarted = tracker.observe("pod", PodCounters(), 0.4)  # the counters went back
    assert restarted is DEFAULT_RATES
    again = tracker.observe("pod", PodCounters(prefill_time_sum=0.3, prefill_time_count=1, prompt_tokens=250), 0.6)
    assert again.prefill_factor == pytest.approx(3.0)  # not averaged with the 2.0 from before the restart


def test_the_page_s_histogram_sums_and_counts_are_read():
    page = (FIXTURES / "synthetic_full_page_v1_48k.txt").read_text()
    counters = parse_metrics(page).counters
    assert counters is not None
    assert counters.ttft_count == 10000 and counters.ttft_sum == pytest.approx(1234.5)
    assert counters.queue_time_count == 10000 and counters.prefill_time_count == 10000
    assert counters.itl_count == 10000 and counters.prompt_tokens == 12345
    assert counters.prefix_hits == 12345 and counters.prefix_queries == 12345


def test_rates_travel_in_the_record_and_bad_values_are_bounded():
    record = PodRecord("http://a:8000", 1.0, PodMetrics(num_requests_running=1), rates=PodRates(2.0, 0.12, 0.3, 90.0, True))
    assert PodRecord.from_json(record.to_json()).rates == record.rates
    hostile = record.to_json().replace(b'"decode_step_s":0.12', b'"decode_step_s":1e9')
    assert PodRecord.from_json(hostile).rates.decode_step_s == 10.0


def _pod(key, rates=DEFAULT_RATES, running=4, adapters=("sql-lora",)):
    return Candidate(key, 0, running, 0.2, frozenset(adapters), max_lora=4, rates=rates)


def test_a_slow_pod_gets_less():
    slow = PodRates(prefill_factor=2.0, decode_step_s=0.12, learned=True)
    chosen = {choose_pod([_pod("fast"), _pod("slow", slow)], RouteRequest("sql-lora"), S, random.Random(i)).pod
              for i in range(50)}
    assert chosen == {"fast"}
    even = {choose_pod([_pod("a"), _pod("b")], RouteRequest("sql-lora"), S, random.Random(i)).pod for i in range(50)}
    assert even == {"a", "b"}  # equal pods still share


def test_a_long_unseen_prompt_for_a_running_adapter_stays_with_its_adapter():
    holder = _pod("holder", running=6)
    empty = Candidate("empty", 0, 0, 0.0, frozenset(), max_lora=4)
    request = RouteRequest("sql-lora", prefix_blocks=40, prefix_hashes=tuple(range(40)), placement_key=9)
    for seed in range(20):
        assert choose_pod([holder, empty], request, S, random.Random(seed)).pod == "holder"


def test_explain_shows_each_candidate_s_cost_parts():
    slow = PodRates(prefill_factor=2.0, decode_step_s=0.12, learned=True)
    request = RouteRequest("sql-lora", prefix_blocks=8, prefix_matches={"fast": 8}, prefix_hashes=tuple(range(8)))
    decision = choose_pod([_pod("fast"), _pod("slow", slow, adapters=("other",))], request, S, random.Random(1),
                          explain=True)
    assert decision.pod == "fast"
    fast, slow_parts = decision.costs["fast"], decision.costs["slow"]
    assert fast.uncached_tokens == 0 and slow_parts.uncached_tokens == 512
    assert slow_parts.adds_adapter and slow_parts.duplicated_tokens == 512 and slow_parts.harm_s > 0
    assert slow_parts.total_s > fast.total_s
    assert "prefill" in slow_parts.describe() and "adds an adapter" in slow_parts.describe()


def test_a_pod_slower_at_both_prefill_and_decode_spills_its_adapter_sooner():
    from lora_affinity_plugin.routing.cost import relative_slowness
    from lora_affinity_plugin.fleet.view import FleetView

    half = PodRates(prefill_factor=2.2, decode_step_s=0.16, learned=True, decode_factor=2.0)
    busy = PodRates(prefill_factor=2.2, decode_step_s=0.16, learned=True)  # a bigger batch's steps: not slower
    assert relative_slowness(half, 1.0, 1.0) == 2.0
    assert relative_slowness(busy, 1.0, 1.0) == 1.0
    fleet = FleetView(S)
    metrics = PodMetrics(num_requests_running=12, running_lora_adapters=frozenset({"sql-lora"}), max_lora=4)
    idle = PodMetrics(num_requests_running=2, max_lora=4)
    fleet.update({"slow": PodRecord("slow", 1.0, metrics, rates=half),
                  "a": PodRecord("a", 1.0, idle, rates=PodRates(1.0, 0.08, learned=True)),
                  "b": PodRecord("b", 1.0, idle, rates=PodRates(1.1, 0.08, learned=True))})
    pods = fleet.candidates(["slow", "a", "b"], 1.0)
    assert {p.key: p.slowness for p in pods} == {"slow": 2.0, "a": 1.0, "b": 1.0}
    # 12 running is within spill_queue_margin (16) of the idle pods' 2, but at half speed it counts as 24.
    decision = choose_pod(pods, RouteRequest("sql-lora"), S, random.Random(1))
    assert decision.pod != "slow" and decision.branch == "spill"
    same_speed = [p if p.key != "slow" else Candidate("slow", 0, 12, 0.2, frozenset({"sql-lora"}), max_lora=4)
                  for p in pods]
    assert choose_pod(same_speed, RouteRequest("sql-lora"), S, random.Random(1)).pod == "slow"


def test_an_unseen_long_prompt_goes_to_the_faster_holder_before_the_emptier_cache():
    slow = PodRates(prefill_factor=2.0, decode_step_s=0.12, learned=True, decode_factor=2.0)
    holders = [Candidate("slow", 0, 3, 0.2, frozenset({"sql-lora"}), max_lora=4, rates=slow, slowness=2.0),
               Candidate("fast", 0, 3, 0.2, frozenset({"sql-lora"}), max_lora=4)]
    unseen = RouteRequest("sql-lora", prefix_blocks=40, prefix_hashes=tuple(range(40)), placement_key=9,
                          prefix_sizes={"slow": 0, "fast": 5_000})  # the slow pod's cache is the emptier
    for seed in range(10):
        assert choose_pod(holders, unseen, S, random.Random(seed)).pod == "fast"
    same_speed = [Candidate("slow", 0, 3, 0.2, frozenset({"sql-lora"}), max_lora=4), holders[1]]
    assert choose_pod(same_speed, unseen, S, random.Random(1)).pod == "slow"  # equals: the emptier cache


def test_the_mixed_workload_mixes_adapters_shapes_and_chats():
    from lora_affinity_lab.bench.prefix_workloads import PrefixWorkload
    from lora_affinity_lab.bench.scenarios import at_rate, get_scenario

    scenario = at_rate(get_scenario("mixed"), 4.0)
    workload = PrefixWorkload(scenario, 1)
    initial = workload.initial()
    chats = [r for r in initial if r.adapter is None]
    adapters = [r.adapter for r in initial if r.adapter is not None]
    assert 0.1 < len(chats) / len(initial) < 0.3
    assert len(set(adapters)) >= 12 and adapters.count("adapter-00") > 3 * adapters.count("adapter-15")  # Zipf
    sizes = {len(r.messages[0]["content"]) for r in initial if r.adapter is not None}
    assert min(sizes) < 100 and max(sizes) >= 8000  # the seed's question up to 8 KB texts
    assert workload.expected(initial) == len(initial) + (scenario.turns - 1) * len(chats)
    follow = workload.follow_up(chats[0], "x " * 10, 5.0)
    assert follow is not None and follow.turn == 1 and follow.messages[-2]["role"] == "assistant"
    assert workload.follow_up(next(r for r in initial if r.adapter), "x", 5.0) is None


def test_a_long_unseen_prompt_leaves_a_full_queued_holder_for_a_pod_that_admits_it_now():
    full = Candidate("holder", 3, 12, 0.97, frozenset({"sql-lora"}), max_lora=4, reported_waiting=3, kv_free_tokens=300)
    idle = Candidate("idle", 0, 2, 0.1, frozenset({"other"}), max_lora=4, kv_free_tokens=10_000)
    long_unseen = RouteRequest("sql-lora", prefix_blocks=40, prefix_hashes=tuple(range(40)), placement_key=9)
    assert choose_pod([full, idle], long_unseen, S, random.Random(1)).pod == "idle"
    # The same holder with the prompt's prefix cached: the prefix rules decide, the adapter stays.
    cached = RouteRequest("sql-lora", prefix_blocks=40, prefix_hashes=tuple(range(40)), placement_key=9,
                          prefix_matches={"holder": 36})
    assert choose_pod([full, idle], cached, S, random.Random(1)).pod == "holder"
    # A holder that admits it at once keeps it (see the test above); so does one where nobody admits it now.
    busy = Candidate("idle", 2, 30, 0.97, frozenset({"other"}), max_lora=4, reported_waiting=2, kv_free_tokens=100)
    assert choose_pod([full, busy], long_unseen, S, random.Random(1)).pod == "holder"


def test_a_long_unseen_prompt_leaves_a_half_speed_holder_for_a_faster_pod():
    slow = PodRates(prefill_factor=2.0, decode_step_s=0.12, learned=True)
    holder = Candidate("slow", 0, 4, 0.2, frozenset({"sql-lora"}), max_lora=4, rates=slow, slowness=2.0,
                       kv_free_tokens=10_000)
    fast = Candidate("fast", 0, 4, 0.2, frozenset({"other"}), max_lora=4, kv_free_tokens=10_000)
    long_unseen = RouteRequest("sql-lora", prefix_blocks=40, prefix_hashes=tuple(range(40)), placement_key=9)
    assert choose_pod([holder, fast], long_unseen, S, random.Random(1)).pod == "fast"
    short = RouteRequest("sql-lora")  # a short question costs little more there: the adapter stays
    assert choose_pod([holder, fast], short, S, random.Random(1)).pod == "slow"


def test_bad_rates_or_counters_cost_the_rates_not_the_pod():
    record = PodRecord("http://a:8000", 1.0, PodMetrics(num_requests_running=1), rates=PodRates(2.0, 0.12, 0.3, 90.0, True))
    garbled = record.to_json().replace(b'"decode_step_s":0.12', b'"decode_step_s":"fast"')
    read = PodRecord.from_json(garbled)
    assert read.metrics == record.metrics and read.rates is None  # routed at the default rates
    assert PodRecord.from_json(record.to_json().replace(b'"rates":{', b'"rates":[{').replace(b'}}', b'}]}')).rates is None
    page = ("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
            'vllm:time_to_first_token_seconds_sum{model_name="m"} NaN\n'
            'vllm:time_to_first_token_seconds_count{model_name="m"} -3\n'
            'vllm:inter_token_latency_seconds_sum{model_name="m"} 2.5\n'
            'vllm:inter_token_latency_seconds_count{model_name="m"} 50\n')
    metrics = parse_metrics(page)
    assert metrics.num_requests_running == 1
    assert metrics.counters.ttft_sum == 0 and metrics.counters.ttft_count == 0 and metrics.counters.itl_count == 50


def test_a_bad_cost_band_is_refused_by_name():
    from lora_affinity_plugin.config.settings import SettingsError

    with pytest.raises(SettingsError, match="cost_band_ratio"):
        build_settings({"cost_band_ratio": -1}, environ={})
    with pytest.raises(SettingsError, match="cost_band_ms"):
        build_settings({"cost_band_ms": "soon"}, environ={})


def test_a_hostile_decode_factor_in_a_record_is_bounded_or_dropped():
    record = PodRecord("http://a:8000", 1.0, PodMetrics(num_requests_running=1),
                       rates=PodRates(2.0, 0.12, 0.3, 90.0, True, decode_factor=2.0))
    assert PodRecord.from_json(record.to_json()).rates.decode_factor == 2.0
    huge = record.to_json().replace(b'"decode_factor":2.0', b'"decode_factor":1e300')
    assert PodRecord.from_json(huge).rates.decode_factor == 100.0
    garbled = record.to_json().replace(b'"decode_factor":2.0', b'"decode_factor":"slow"')
    read = PodRecord.from_json(garbled)
    assert read.metrics == record.metrics and read.rates is None  # routed at the default rates, not dropped


def test_a_prefill_s_cache_hits_counted_a_scrape_before_its_tokens_still_count_against_them():
    """vLLM counts a request's cache hits when it is scheduled and its prompt tokens when its prefill ends: a
    half-speed pod whose long prefill spanned a scrape must still read 2x, not faster than the fleet."""
    from lora_affinity_plugin.routing.podstate import PREFILL_OVERHEAD_S, PREFILL_S_PER_TOKEN

    taken = 2 * (PREFILL_OVERHEAD_S + 400 * PREFILL_S_PER_TOKEN)  # 400 of 2,400 tokens computed, at half speed
    tracker = RateTracker()
    tracker.observe("pod", PodCounters(), 0.0)
    scheduled = PodCounters(prefix_hits=2000, prefix_queries=2400)
    tracker.observe("pod", scheduled, 0.2)
    ended = PodCounters(prefix_hits=2000, prefix_queries=2400, prompt_tokens=2400, prefill_time_sum=taken,
                        prefill_time_count=1)
    assert tracker.observe("pod", ended, 0.4).prefill_factor == pytest.approx(2.0)
    # A page without the queries counter (an older server) keeps the plain difference of the interval.
    tracker = RateTracker()
    tracker.observe("pod", PodCounters(), 0.0)
    tracker.observe("pod", PodCounters(prefix_hits=2000), 0.2)
    plain = tracker.observe("pod", PodCounters(prefix_hits=2000, prompt_tokens=2400, prefill_time_sum=taken,
                                               prefill_time_count=1), 0.4)
    assert plain.prefill_factor < 1.0


def test_a_queries_counter_that_goes_back_or_reads_fewer_than_the_hits_costs_nothing_but_its_share():
    """A bad queries counter (reset alone, or under the hits) must not break the rate or the pod: the plain
    difference stands in where the queries went back, and more hits than queries read as the whole prompt cached."""
    from lora_affinity_plugin.routing.podstate import PREFILL_OVERHEAD_S, PREFILL_S_PER_TOKEN, RATE_BOUNDS

    taken = PREFILL_OVERHEAD_S + 400 * PREFILL_S_PER_TOKEN
    tracker = RateTracker()
    tracker.observe("pod", PodCounters(prefix_hits=5000, prefix_queries=9000), 0.0)
    went_back = PodCounters(prefix_hits=7000, prefix_queries=100, prompt_tokens=2400, prefill_time_sum=taken,
                            prefill_time_count=1)  # queries went back; the prompt's 2,000 hits are this interval's
    assert tracker.observe("pod", went_back, 0.2).prefill_factor == pytest.approx(1.0)
    tracker = RateTracker()
    tracker.observe("pod", PodCounters(), 0.0)
    over = PodCounters(prefix_hits=3000, prefix_queries=2400, prompt_tokens=2400, prefill_time_sum=taken,
                       prefill_time_count=1)  # more hits than queries: the share is capped at the whole prompt
    factor = tracker.observe("pod", over, 0.2).prefill_factor
    assert factor == pytest.approx(taken / PREFILL_OVERHEAD_S)  # 2.6: all of it read as cached, none below
    assert factor < RATE_BOUNDS["prefill_factor"][1]
