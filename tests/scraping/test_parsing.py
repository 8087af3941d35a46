"""The metrics parser on every published page in tests/fixtures/vllm-metrics, and on bad pages."""

import math

import pytest

from lora_affinity_plugin.scraping.worker import MetricsPageError, parse_metrics
import paths

# Real pages (tests/fixtures/vllm-metrics/README.txt gives each page's origin).
FIXTURES = paths.FIXTURES / "vllm-metrics"


def page(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_v0_7_old_kv_name_and_empty_lora_lists():
    m = parse_metrics(page("aibrix__docs_source_features_runtime.rst__vllm_v0_7.txt"))
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (0, 0, 0.0)
    assert m.running_lora_adapters == frozenset() and m.waiting_lora_adapters == frozenset()
    assert m.max_lora == 0
    assert (m.block_size, m.num_gpu_blocks) == (16, 81767)
    assert m.model_names == {"Qwen/Qwen2.5-Coder-1.5B-Instruct"}


def test_lora_info_takes_the_series_with_the_largest_timestamp():
    text = page("gie__issue354__vllm_pull13303__lora_requests_info_multi_series.txt")
    text += "\nvllm:num_requests_running 1.0\n"
    m = parse_metrics(text)
    assert m.running_lora_adapters == {"test-lora"}
    assert m.waiting_lora_adapters == frozenset()  # the 1.7395575723949368e+09 series, not the older one
    assert m.max_lora == 1


def test_simulator_lines_two_series_comma_separated_adapters():
    text = page("llm-d-inference-sim__pkg_tests_fake_metrics_test.go__SIMULATED_expected_lines.txt")
    m = parse_metrics(text + "\nvllm:num_requests_waiting 0\n")
    assert m.running_lora_adapters == {"lora4", "lora3"}
    assert m.waiting_lora_adapters == frozenset()


def test_v1_still_old_kv_name():
    m = parse_metrics(page("production-stack__issue318__vllm_v1_gpu_cache_usage_perc_excerpt.txt"))
    assert (m.num_requests_running, m.num_requests_waiting) == (0, 0)
    assert m.max_lora is None


def test_v0_10_new_kv_name_with_engine_label():
    text = page("production-stack__issue617__vllm_0.10.0_kv_cache_usage_perc_excerpt.txt")
    m = parse_metrics(text + '\nvllm:num_requests_running{engine="0",model_name="zai-org/GLM-4.5"} 2\n')
    assert m.num_requests_running == 2
    assert m.kv_cache_usage == pytest.approx(9.75010481363281e-06)


def test_v1_docs_example_with_elisions():
    m = parse_metrics(page("vllm-project__vllm__docs_design_metrics.md__v1_example_elided.txt"))
    assert m.num_requests_running == 8
    assert m.block_size == 16  # the label set contains a literal "..." elision


def test_commented_capture_of_a_0_9_server():
    raw = page("unresolved__curl_metrics_qwen3-0.6B_2025-08-14__excerpts.txt")
    text = "\n".join(line[2:] if line.startswith("# vllm:") else line for line in raw.splitlines())
    m = parse_metrics(text)
    assert (m.num_requests_running, m.num_requests_waiting, m.max_lora, m.num_gpu_blocks) == (0, 0, 1, 2340)


def test_v0_6_gauges():
    m = parse_metrics(page("unresolved__python_test_vllmComposer_mock_metrics_response__vllm_v0_6.txt"))
    assert (m.num_requests_running, m.num_requests_waiting) == (3, 2)
    assert m.num_gpu_blocks == 11560


def test_idle_pod_newest_series_is_empty():
    text = page("unresolved__study_notes_lab5_multi_lora_live_curl__vllm_2026.txt")
    m = parse_metrics(text + "\nvllm:num_requests_running 0\n")
    assert m.running_lora_adapters == frozenset() and m.max_lora == 2


def test_original_label_names_of_the_first_proposal():
    text = page("vllm-project__vllm__pull9477_description__lora_requests_info_original.txt")
    m = parse_metrics(text + "\nvllm:num_requests_running 0\n")
    assert m.max_lora == 1


def test_full_48k_page():
    m = parse_metrics(page("synthetic_full_page_v1_48k.txt"))
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (7, 9, 0.42)
    assert m.running_lora_adapters == {"sql-lora", "tweet-summary-2"}
    assert m.waiting_lora_adapters == {"sql-lora-2"}
    assert (m.max_lora, m.block_size, m.num_gpu_blocks) == (4, 16, 700)


def test_engines_fold_queues_summed_kv_mean():
    text = "\n".join([
        'vllm:num_requests_running{engine="0",model_name="m"} 3',
        'vllm:num_requests_running{engine="1",model_name="m"} 4',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6',
    ])
    m = parse_metrics(text)
    assert (m.num_requests_running, m.num_requests_waiting) == (7, 3)
    assert m.kv_cache_usage == pytest.approx(0.4)


def test_escaped_labels_and_residency_metric():
    text = "\n".join([
        'vllm:num_requests_running{model_name="a \\"quoted\\" \\\\ name"} 1',
        'vllm:lora_adapter_loaded{adapter_name="sql-lora",level="gpu"} 1',
        'vllm:lora_adapter_loaded{adapter_name="cpu-only",level="cpu"} 1',
    ])
    m = parse_metrics(text)
    assert m.model_names == {'a "quoted" \\ name'}
    assert m.loaded_lora_adapters == {"sql-lora"}


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "not a vLLM metrics page"),
        ("<html>502 Bad Gateway</html>", "not a vLLM metrics page"),
        ("vllm:num_requests_running{model_name=\"m\"} NaN", "not a request count"),
        ("vllm:num_requests_waiting -3", "not a request count"),
        ("vllm:num_requests_waiting 1e300", "not a request count"),
        ("vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 1.5", "outside 0..1"),
        ("vllm:num_requests_running 1\nvllm:kv_cache_usage_perc +Inf", "outside 0..1"),
        ("vllm:num_requests_running abc", "is not a number"),
        ("vllm:num_requests_running{model_name=\"m\"", "unterminated label set"),
        ("vllm:num_requests_running", "has no value"),
    ],
)
def test_bad_pages_are_refused_with_the_reason(text, needle):
    with pytest.raises(MetricsPageError, match=needle.replace("+", r"\+")):
        parse_metrics(text)


def test_nan_lora_timestamp_is_ignored_not_fatal():
    m = parse_metrics('vllm:num_requests_running 2\nvllm:lora_requests_info{max_lora="4",running_lora_adapters="a",waiting_lora_adapters=""} NaN')
    assert m.num_requests_running == 2 and m.max_lora is None and not math.isnan(m.kv_cache_usage)


def test_current_vllm_form_running_and_waiting_lists_identical_slots_and_pinned():
    page = (FIXTURES / "SYNTHETIC__vllm_current_lora_form.txt").read_text()
    m = parse_metrics(page)
    assert m.running_lora_adapters == m.waiting_lora_adapters == {"sql-lora", "tweet-summary"}
    assert m.max_lora == 4
    assert m.loaded_lora_adapters == {"sql-lora", "tweet-summary", "support-bot"}  # pinned counts; cpu does not


def test_slots_come_from_max_gpu_lora_adapters_when_lora_requests_info_has_none():
    page = ('vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
            'vllm:max_gpu_lora_adapters{engine="0",model_name="m"} 8.0\n')
    assert parse_metrics(page).max_lora == 8


ENGINE_FIXTURES = paths.FIXTURES / "engines"


def test_an_sglang_page_maps_to_the_same_record():
    m = parse_metrics((ENGINE_FIXTURES / "sglang.txt").read_text(), engine="sglang")
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (7, 3, 0.62)
    assert (m.block_size, m.num_gpu_blocks, m.max_lora, m.engine) == (1, 21000, 8, "sglang")
    assert m.running_lora_adapters == frozenset()  # SGLang names no adapters: residency stands in


def test_a_trtllm_serve_page_maps_to_the_same_record():
    m = parse_metrics((ENGINE_FIXTURES / "trtllm.txt").read_text(), engine="trtllm")
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (12, 4, 0.35)
    assert (m.block_size, m.num_gpu_blocks, m.max_lora, m.engine) == (32, 4096, None, "trtllm")


def test_a_page_read_with_the_wrong_profile_names_the_server_it_expected():
    with pytest.raises(MetricsPageError, match="not a SGLang metrics page"):
        parse_metrics((FIXTURES / "synthetic_full_page_v1_48k.txt").read_text(), engine="sglang")


def test_a_deployment_naming_an_unknown_engine_is_refused_with_the_choices():
    from lora_affinity_plugin.scraping.engines import pod_engines

    model_list = [{"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": "http://a:8000/v1"},
                   "model_info": {"engine": "tgi"}}]
    with pytest.raises(ValueError, match="model_info.engine: 'tgi' is not one of vllm, sglang, trtllm"):
        pod_engines(model_list, "vllm")
    model_list[0]["model_info"] = {"engine": "sglang"}
    assert pod_engines(model_list, "vllm") == {"http://a:8000": "sglang"}


@pytest.mark.parametrize("line", [
    'vllm:cache_config_info{block_size="1e200",num_gpu_blocks="1e200"} 1.0',
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="1e15"} 1.0',
    'vllm:cache_config_info{block_size="99999999",num_gpu_blocks="100"} 1.0',
    'vllm:lora_requests_info{max_lora="1e30",running_lora_adapters="",waiting_lora_adapters=""} 1.0',
])
def test_numbers_that_size_things_are_bounded_and_name_the_field(line):
    page = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n" + line + "\n"
    with pytest.raises(MetricsPageError, match="is larger than"):
        parse_metrics(page)


def test_an_index_is_bounded_whatever_a_record_from_redis_says():
    from lora_affinity_plugin.fleet.view import FleetView
    from lora_affinity_plugin.kv.prefix_index import MAX_CAPACITY
    from lora_affinity_plugin.config.settings import build_settings

    fleet = FleetView(build_settings({}, environ={}))
    fleet._size_index("http://pod-a:8000", 10**200, 10**200)  # no OverflowError
    assert fleet.prefixes.capacity("http://pod-a:8000") == MAX_CAPACITY
