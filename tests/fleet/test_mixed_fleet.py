"""A real fleet, in units: proven pods only, the metrics token only where named, records across versions,
clocks apart, pages read in part, a failover that keeps what was learned, sprayed adapter names, isolation."""

from __future__ import annotations

import json
import logging
import random
import time
import types
from contextlib import contextmanager

import fakeredis
import litellm
import pytest
import record_format1
from page_server import serve_pages

from lora_affinity_plugin.host import compat
from lora_affinity_plugin.fleet import follower as follower_mod
from lora_affinity_plugin.scraping import worker as scraper_mod
from lora_affinity_plugin.fleet.clock import RedisClock
from lora_affinity_plugin.routing.podstate import PodRates
from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.fleet.follower import Follower
from lora_affinity_plugin.scraping.parsing import MetricsPageError, parse_metrics
from lora_affinity_plugin.fleet.pods import discover_pods, pod_marks, token_pods
from lora_affinity_plugin.kv.prefixes import prompt_prefix
from lora_affinity_plugin.routing.scheduling import Candidate, RouteRequest, choose_pod
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.scraping.worker import Scraper
from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.store import FORMAT, PodRecord, pod_key
from records import read_records
from lora_affinity_plugin.strategy import LoraAffinityStrategy

GOOD = 'vllm:num_requests_running{model_name="m"} 3\nvllm:num_requests_waiting{model_name="m"} 1\n'
BAD_KV = GOOD + 'vllm:kv_cache_usage_perc{model_name="m"} 7.5\nvllm:lora_requests_info{max_lora="x"} oops\n'
BAD_QUEUE = 'vllm:num_requests_running{model_name="m"} 3\nvllm:num_requests_waiting{model_name="m"} -4\n'


# --- records across versions ---------------------------------------------------------------------------
def test_a_format_2_reader_takes_format_1_records_and_a_newer_formats_unknown_and_missing_fields():
    metrics = PodMetrics(num_requests_waiting=2, num_requests_running=1, running_lora_adapters=frozenset({"a"}))
    old = PodRecord.from_json(record_format1.write("http://p:1", 10.0, metrics))
    assert old.metrics == metrics and old.proven and old.scraped_at == 10.0
    newer = {"v": 7, "pod": "http://p:1", "scraped_at": 11.0, "proven": True, "shiny": {"x": 1},
             "metrics": {"num_requests_waiting": 5, "future_gauge": 0.3, "kv_cache_usage": "a string now",
                         "running_lora_adapters": ["b"], "counters": {"ttft_sum": 1.0, "new_sum": 2.0}}}
    read = PodRecord.from_json(json.dumps(newer))
    assert read.metrics.num_requests_waiting == 5 and read.metrics.num_requests_running == 0  # missing: default
    assert read.metrics.kv_cache_usage == 0.0  # a type this version does not know: default, record kept
    assert read.metrics.running_lora_adapters == {"b"} and read.metrics.counters.ttft_sum == 1.0
    down = PodRecord.from_json(json.dumps({"v": 7, "pod": "http://p:1", "scraped_at": 1, "proven": True}))
    assert down.metrics is None and down.proven


def test_a_format_1_reader_takes_what_format_2_writes():
    metrics = parse_metrics(GOOD)
    record = PodRecord("http://p:1", 10.0, metrics, rates=PodRates(2.0, learned=True), degraded=("x: bad",))
    raw = record.to_json()
    assert json.loads(raw)["v"] == FORMAT == 2
    old = record_format1.read(raw)
    assert old["metrics"] == metrics and old["scraped_at"] == 10.0


# --- which deployments are pods, who gets the token ----------------------------------------------------
MODEL_LIST = [
    {"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": "http://vllm-0.svc:8000/v1"}},
    {"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": "http://10.1.1.1:8000/v1"},
     "model_info": {"lora_affinity_pod": True}},
    {"model_name": "gpt", "litellm_params": {"model": "azure/gpt", "api_base": "https://x.openai.azure.com"}},
    {"model_name": "gpt", "litellm_params": {"model": "openai/gpt", "api_base": "https://api.other.ai/v1"},
     "model_info": {"lora_affinity_pod": False}},
]


def test_the_metrics_token_goes_only_to_pods_named_for_it():
    assert discover_pods(MODEL_LIST) == ["http://vllm-0.svc:8000", "http://10.1.1.1:8000", "https://x.openai.azure.com:443"]
    pods, marks = discover_pods(MODEL_LIST), pod_marks(MODEL_LIST)
    assert token_pods(pods, marks, []) == {"http://10.1.1.1:8000"}
    assert token_pods(pods, marks, ["vllm-*.svc:8000"]) == {"http://vllm-0.svc:8000", "http://10.1.1.1:8000"}
    assert token_pods(pods, marks, ["*"]) == set(pods)  # the operator's own choice


def test_a_pod_mark_that_is_neither_true_nor_false_is_said_and_ignored():
    model_list = [{"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": "http://p:1/v1"},
                   "model_info": {"lora_affinity_pod": "maybe"}},
                  {"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": "http://q:1/v1"},
                   "model_info": {"lora_affinity_pod": "off"}}]
    with logged() as records:
        assert pod_marks(model_list) == {"http://q:1": False} and pod_marks(model_list)
    assert discover_pods(model_list) == ["http://p:1"]  # still scraped: its page decides
    warnings = [r.getMessage() for r in records if "lora_affinity_pod" in r.getMessage()]
    assert len(warnings) == 1 and "'maybe' is not allowed (true or false)" in warnings[0]


async def test_the_scraper_sends_the_token_to_named_pods_only():
    seen: list = []
    async with serve_pages({"pod": GOOD, "hosted": 404}, seen) as url:
        settings = build_settings({"metrics_bearer_token": "s3cret"})
        scraper = Scraper(settings, [url("pod"), url("hosted")], fakeredis.aioredis.FakeRedis(), token_pods=[url("pod")])
        records = {r.pod: r for r in await scraper.scrape_once()}
        await scraper.aclose()
    assert dict(seen) == {"pod": "Bearer s3cret", "hosted": None}
    assert records[url("pod")].proven and not records[url("hosted")].proven


async def test_a_pod_stays_proven_when_it_fails_and_a_new_scraper_starts_from_the_last_ones_rates():
    redis = fakeredis.aioredis.FakeRedis()
    settings = build_settings({"scraper_lease_ms": 100})
    pages = {"a": GOOD}
    async with serve_pages(pages) as url:
        first = Scraper(settings, [url("a")], redis)
        await first.scrape_once()
        learned = PodRates(1.8, 0.05, learned=True)
        first.rates.seed(url("a"), learned)  # as if learned: write a record that carries rates
        await redis.set(pod_key(settings, url("a")), PodRecord(url("a"), time.time(), parse_metrics(GOOD),
                                                              rates=learned, proven=True).to_json())
        pages["a"] = 500
        await redis.delete("{lora_affinity}:scraper:lease")  # the first scraper is gone
        second = Scraper(settings, [url("a")], redis)
        (down,) = await second.scrape_once()
        assert down.metrics is None and down.proven  # proven by the record it took over
        pages["a"] = GOOD
        (back,) = await second.scrape_once()
        assert back.rates == learned  # the first record after failover carries the learned rates
        await first.aclose()
        await second.aclose()


# --- pages read in part -------------------------------------------------------------------------------
def test_a_page_with_a_malformed_family_still_describes_its_pod():
    problems: list[str] = []
    metrics = parse_metrics(BAD_KV, problems=problems)
    assert (metrics.num_requests_running, metrics.num_requests_waiting) == (3, 1)
    assert any("outside 0..1" in p for p in problems) and len(problems) == 2
    with pytest.raises(MetricsPageError):
        parse_metrics(BAD_KV)  # without a list to describe them in, a bad sample is an error as before
    with pytest.raises(MetricsPageError, match="not a request count"):
        parse_metrics(BAD_QUEUE, problems=[])  # no queue figure: nothing to route on


async def test_the_scraper_routes_a_partial_page_and_keeps_the_last_good_figures_while_fresh():
    redis = fakeredis.aioredis.FakeRedis()
    pages = {"a": BAD_KV}
    async with serve_pages(pages) as url:
        scraper = Scraper(build_settings({"stale_after_ms": 500, "metrics_ttl_ms": 5000}), [url("a")], redis)
        (partial,) = await scraper.scrape_once()
        assert partial.metrics.num_requests_running == 3 and partial.degraded
        pages["a"] = GOOD
        (good,) = await scraper.scrape_once()
        pages["a"] = BAD_QUEUE
        (kept,) = await scraper.scrape_once()
        assert kept.metrics == good.metrics and kept.scraped_at == good.scraped_at and "last good" in kept.degraded[0]
        time.sleep(0.6)
        (gone,) = await scraper.scrape_once()
        assert gone.metrics is None and "not a request count" in gone.error and gone.proven
        await scraper.aclose()


# --- clocks -------------------------------------------------------------------------------------------
def skewed(module, monkeypatch, skew_s: float) -> None:
    """`module`'s clock `skew_s` ahead of Redis's (fakeredis answers TIME from this machine's clock)."""
    fake = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    fake.time = lambda: time.time() + skew_s
    monkeypatch.setattr(module, "time", fake)


def test_the_clock_takes_the_shortest_round_trip():
    clock = RedisClock()
    clock.observe(1000.0, 996.0, 998.0)  # 2 s there and back: uncertain
    clock.observe(1003.0, 1000.0, 1000.01)
    assert clock.offset_s == pytest.approx(2.995) and clock.to_local(clock.to_redis(5.0)) == 5.0


@pytest.mark.parametrize("scraper_skew, proxy_skew", [(3.0, 0.0), (-3.0, 0.0), (0.0, 3.0), (2.0, -2.0)])
async def test_ages_and_counted_requests_hold_with_clocks_seconds_apart(monkeypatch, scraper_skew, proxy_skew):
    redis = fakeredis.aioredis.FakeRedis()
    settings = build_settings({"scrape_interval_ms": 100, "dispatch_lag_ms": 1000})  # lag: a slow machine's scrape
    skewed(scraper_mod, monkeypatch, scraper_skew)
    skewed(follower_mod, monkeypatch, proxy_skew)
    async with serve_pages({"a": GOOD}) as url:
        scraper = Scraper(settings, [url("a")], redis)
        await scraper.scrape_once()  # takes the lease: learns its offset
        proxy = Follower(settings, FleetView(settings), lambda: [url("a")], lambda s: None)
        await proxy.refresh(redis)
        proxy_now = time.time() + proxy_skew
        proxy.fleet.note_dispatch(url("a"), None, proxy_now, call_id="sent-after-the-scrape")
        # The scrape stamps its time with the offset learned so far; its own round trip, after the stamp, may
        # then narrow the scraper's error: the stamp's error is the one before
        stamp_error_s = scraper.clock.error_s
        await scraper.scrape_once()  # scraped after the request was sent ...
        scraped_by = time.time() + proxy_skew
        await proxy.refresh(redis)
        record = proxy.fleet.record(url("a"))
        # ... so, on the proxy's own clock, between the dispatch and the scrape's end, give or take the offsets'
        # error (half the round trip each offset was read in: `RedisClock.error_s`)
        slack = scraped_by - proxy_now + proxy.clock.error_s + max(stamp_error_s, scraper.clock.error_s)
        assert proxy_now - slack <= record.scraped_at <= scraped_by + slack, (proxy_now, record.scraped_at, scraped_by)
        (view,) = proxy.fleet.candidates([url("a")], proxy_now + 0.1)
        assert view.waiting == 1 + 1  # the pod's own 1, and the dispatch: the newer scrape came within its lag
        await scraper.aclose()


# --- proven pods only, in the strategy -----------------------------------------------------------------
PODS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
HOSTED = ["https://api.a.example:443", "https://api.b.example:443"]


def mixed_router():
    model_list = [{"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": p + "/v1"}} for p in PODS]
    model_list += [{"model_name": "gpt", "litellm_params": {"model": "openai/gpt", "api_base": h + "/v1", "api_key": "k",
                                                            "weight": w}} for h, w in zip(HOSTED, (9, 1))]
    router = litellm.Router(model_list=model_list, num_retries=0)
    settings = build_settings({})
    strategy = LoraAffinityStrategy(router, settings, rng=random.Random(1), fleet=FleetView(settings))
    compat.register_strategy(router, strategy)
    now = time.time()
    strategy.fleet.update({**{p: PodRecord(p, now, PodMetrics(num_requests_running=1)) for p in PODS},
                           **{h: PodRecord(h, now, None, "HTTP 404 from /metrics") for h in HOSTED}})
    return router, strategy


async def test_a_hosted_group_with_an_api_base_stays_litellms_with_its_weights():
    router, strategy = mixed_router()
    picks = [(await compat.router_pick(router, "gpt", {}))["litellm_params"]["api_base"]
             for _ in range(200)]
    heavy = picks.count(HOSTED[0] + "/v1")
    assert 160 <= heavy <= 196  # weight 9 of 10: LiteLLM's simple-shuffle, not a uniform pick
    assert strategy.decisions == 0 and strategy.fallbacks == 0
    await compat.router_pick(router, "sql-lora", {})
    assert strategy.decisions == 1  # the pods' group is routed


async def test_a_group_that_mixes_pods_and_a_hosted_deployment_goes_to_its_pods_and_overflows_as_litellm():
    """The pods are routed by the rules while any has fresh metrics; the hosted deployment serves only when none
    has (then LiteLLM's own pick chooses among them all, as without the plugin)."""
    model_list = [{"model_name": "chat", "litellm_params": {"model": "hosted_vllm/m", "api_base": p + "/v1"}} for p in PODS]
    model_list.append({"model_name": "chat", "litellm_params": {"model": "openai/gpt", "api_base": HOSTED[0] + "/v1",
                                                                "api_key": "k"}})
    router = litellm.Router(model_list=model_list, num_retries=0)
    settings = build_settings({"stale_after_ms": 100, "metrics_ttl_ms": 200})
    strategy = LoraAffinityStrategy(router, settings, rng=random.Random(1), fleet=FleetView(settings))
    compat.register_strategy(router, strategy)
    now = time.time()
    strategy.fleet.update({**{p: PodRecord(p, now, PodMetrics(num_requests_running=1)) for p in PODS},
                           HOSTED[0]: PodRecord(HOSTED[0], now, None, "HTTP 404 from /metrics")})

    async def bases(n):
        return {(await compat.router_pick(router, "chat", {}))["litellm_params"]["api_base"]
                for _ in range(n)}

    assert await bases(40) == {p + "/v1" for p in PODS}
    time.sleep(0.25)  # every pod's metrics past metrics_ttl_ms
    assert HOSTED[0] + "/v1" in await bases(60)
    assert strategy.fallbacks == 60  # the pods' group counts its fallbacks: its pods are down, which is news


def test_sprayed_adapter_names_stay_out_of_the_residency_memory():
    fleet = FleetView(build_settings({"residency_memory": 4}))
    fleet.adapters.serve(["listed"])
    fleet.update({"a": PodRecord("a", time.time(), PodMetrics(max_lora=1))})
    fleet.note_dispatch("a", "listed", time.time(), call_id="l")
    fleet.note_dispatch("a", "served", time.time(), call_id="s")
    fleet.confirm(fleet.end("s"))  # a pod answered it
    for i in range(50):
        fleet.note_dispatch("a", f"junk-{i}", time.time(), call_id=f"c{i}")
    (view,) = fleet.candidates(["a"], time.time())
    assert view.waiting == 51 and len(view.active_adapters) == 51  # in flight, each counts
    for i in range(50):
        fleet.end(f"c{i}")  # vLLM refused each made-up name at once
    fleet.end("l")
    fleet.update({"a": PodRecord("a", time.time(), PodMetrics(max_lora=1))})
    (view,) = fleet.candidates(["a"], time.time())
    assert set(view.resident_adapters) == {"listed", "served"}  # real adapters remembered, junk never was


# --- settings that would make routing random -------------------------------------------------------------
def test_disabling_dealt_turns_dealing_off_instead_of_picking_at_random():
    settings = build_settings({"disabled_rules": ["dealt"]})
    pods = [Candidate(f"p{i}", 0, 1, 0.1, frozenset({f"other{i}"}), max_lora=1) for i in range(6)]
    request = RouteRequest("sql", False, placement_key=7, gateways=3, home="p0", dealt_adapters=12)
    chosen = {choose_pod(pods, request, settings, random.Random(seed)).pod for seed in range(30)}
    assert len(chosen) == 1  # the gateways' agreed placement (rendezvous), not a pod at random per request


# --- isolation ------------------------------------------------------------------------------------------
def test_prefix_isolation_keys_the_index_by_team_or_key():
    messages = [{"role": "system", "content": "You are a careful assistant. " * 40}, {"role": "user", "content": "hi"}]

    def chain(isolation, key, team=None):
        meta = {"user_api_key_hash": key, "user_api_key_team_id": team}
        return prompt_prefix(messages, "m", {"metadata": meta}, build_settings({"prefix_isolation": isolation}))

    assert chain("off", "k1") == chain("shared", "k2") == chain(False, "k3")  # `off`: YAML's false too
    assert chain("key", "k1") != chain("key", "k2") and chain("key", "k1") == chain("key", "k1")
    assert chain("team", "k1", "t") == chain("team", "k2", "t") != chain("team", "k3", "u")
    assert chain("team", "k1") != chain("team", "k2")  # a key in no team is a team of its own


@contextmanager
def logged():
    """The plugin's log records while the block runs (its logger does not propagate inside a proxy)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    log = logging.getLogger("lora_affinity")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


# --- the host moved -------------------------------------------------------------------------------------
async def test_a_moved_litellm_internal_is_said_once_and_left_to_litellm(monkeypatch):
    from litellm.proxy import proxy_server

    from lora_affinity_plugin.host.proxy_callback import ProxyPlugin

    router = litellm.Router(model_list=[{"model_name": "*", "litellm_params": {"model": "hosted_vllm/*",
                                                                                "api_base": PODS[0]}}])
    monkeypatch.setattr(proxy_server, "llm_router", router)
    monkeypatch.setattr(proxy_server, "user_config_file_path", None)
    monkeypatch.setattr(compat, "registered_strategy", lambda router: None)  # where the strategy is kept moved
    monkeypatch.setattr("lora_affinity_plugin.host.host_strategy.registered_strategy", lambda router: None)
    plugin = ProxyPlugin()
    try:
        with logged() as records:
            for _ in range(20):
                assert plugin.ensure_installed() is None
        errors = [r for r in records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "cannot route on LiteLLM" in errors[0].getMessage()
        assert "installed" not in " ".join(r.getMessage() for r in records)
    finally:
        plugin._watcher and plugin._watcher.cancel()


async def test_a_bad_config_is_read_once_per_change(monkeypatch, tmp_path):
    from litellm.proxy import proxy_server

    from lora_affinity_plugin.host import proxy_callback

    config = tmp_path / "config.yaml"
    config.write_text("lora_affinity:\n  scrape_interval_ms: -5\n")
    monkeypatch.setattr(proxy_server, "user_config_file_path", str(config))
    reads = []
    original = proxy_callback.load_config
    monkeypatch.setattr(proxy_callback, "load_config", lambda path: reads.append(path) or original(path))
    plugin = proxy_callback.ProxyPlugin()
    try:
        with logged() as records:
            assert [plugin.settings() for _ in range(50)] == [None] * 50
        assert len(reads) == 1 and sum("scrape_interval_ms" in r.getMessage() for r in records) == 1
        config.write_text("lora_affinity:\n  scrape_interval_ms: 100\n")
        plugin._next_config_check = 0.0  # a second later
        assert plugin.settings().scrape_interval_ms == 100 and len(reads) == 2
    finally:
        plugin._watcher and plugin._watcher.cancel()


async def test_records_on_redis_time_read_back(monkeypatch):
    """Records read back (as status and explain read them) are as written: Redis's clock, not the reader's."""
    redis = fakeredis.aioredis.FakeRedis()
    settings = build_settings({})
    skewed(scraper_mod, monkeypatch, 5.0)
    async with serve_pages({"a": GOOD}) as url:
        scraper = Scraper(settings, [url("a")], redis)
        await scraper.scrape_once()
        await scraper.scrape_once()
        await scraper.aclose()
        (record,) = (await read_records(redis, settings, [url("a")])).values()
    assert abs(record.scraped_at - time.time()) < 0.5
