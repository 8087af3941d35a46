"""Property-based fuzz of the parser and the scraper: garbage never crashes them; a bad page marks
that pod with a reason, and the others are untouched."""

import asyncio
import os

import fakeredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from page_server import serve_pages

from lora_affinity_plugin.scraping.worker import MetricsPageError, Scraper, parse_metrics
from lora_affinity_plugin.config.settings import build_settings
from records import read_records

NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info", "vllm:lora_adapter_loaded",
         "vllm:other_total"]
values = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers(-10**30, 10**30).map(str),
                   st.sampled_from(["NaN", "+Inf", "-Inf", "", "abc", "1e999", "0x10", "1_000"]))
label_values = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
labels = st.dictionaries(st.sampled_from(["engine", "model_name", "running_lora_adapters", "waiting_lora_adapters",
                                          "max_lora", "block_size", "num_gpu_blocks", "adapter_name", "level"]),
                         label_values, max_size=5)


@st.composite
def lines(draw):
    name = draw(st.sampled_from(NAMES))
    lab = draw(labels)
    body = ",".join(f'{k}="{v}"' for k, v in lab.items())
    line = f"{name}{{{body}}} {draw(values)}" if draw(st.booleans()) else f"{name} {draw(values)}"
    cut = draw(st.integers(0, len(line)))
    return line[:cut] if draw(st.booleans()) and cut else line


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "400")), suppress_health_check=[HealthCheck.too_slow],
          deadline=None)
@given(st.lists(lines(), max_size=30), st.binary(max_size=64))
def test_parser_returns_a_record_or_a_clear_error(page_lines, noise):
    text = "\n".join(page_lines) + noise.decode("utf-8", errors="replace")
    try:
        m = parse_metrics(text)
    except MetricsPageError as exc:
        assert str(exc)
        return
    assert m.num_requests_running >= 0 and m.num_requests_waiting >= 0
    assert 0.0 <= m.kv_cache_usage <= 1.0
    assert m.max_lora is None or m.max_lora >= 0


@settings(max_examples=max(60, int(os.environ.get("FUZZ_EXAMPLES", "60")) // 8), suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
          deadline=None)
@given(st.binary(max_size=2048), st.sampled_from([200, 200, 500, 404]))
def test_scraper_marks_only_the_bad_pod(garbage, status):
    good = "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"

    async def run():
        redis = fakeredis.aioredis.FakeRedis()
        settings = build_settings({"max_page_bytes": 1024}, environ={})
        async with serve_pages({"good": good, "bad": garbage if status == 200 else status}) as url:
            pods = [url("good"), url("bad")]
            scraper = Scraper(settings, pods, redis)
            await asyncio.wait_for(scraper.scrape_once(), 5)
            await scraper.aclose()
        return list((await read_records(redis, settings, pods)).values())

    good_record, bad = asyncio.run(run())
    assert good_record.ok and good_record.metrics.num_requests_running == 2
    if status != 200:
        assert not bad.ok and bad.error == f"HTTP {status} from /bad/metrics", bad.error
        return
    if len(garbage) > 1024:
        assert not bad.ok and bad.error == "page larger than max_page_bytes=1024", bad.error
        return
    try:  # what the pod's record must say is what the parser says of the same bytes
        expected = parse_metrics(garbage.decode("utf-8", errors="replace"))
    except MetricsPageError as exc:
        assert not bad.ok and bad.error == str(exc)
    else:
        assert bad.ok and bad.metrics == expected


def test_a_page_of_many_megabytes_is_refused_without_reading_it_all():
    big = "vllm:num_requests_running 1\n" + "# padding\n" * 1_000_000

    async def run():
        redis = fakeredis.aioredis.FakeRedis()
        settings = build_settings({}, environ={})
        async with serve_pages({"huge": big}) as url:
            scraper = Scraper(settings, [url("huge")], redis)
            record = (await scraper.scrape_once())[0]
            await scraper.aclose()
        return record

    record = asyncio.run(run())
    assert record.error == "page larger than max_page_bytes=4194304"
