"""One settings model: defaults, the config section, env overrides, clear errors, no secrets."""

import pytest

from lora_affinity_plugin.config.settings import (
    Settings,
    SettingsError,
    build_settings,
    redact_url,
    settings_from_config,
)
from paths import ROOT


def test_defaults_are_the_endpoint_pickers():
    s = build_settings({}, environ={})
    assert (s.queueing_threshold_lora, s.lora_affinity_threshold, s.kv_cache_threshold,
            s.queue_threshold_critical, s.scrape_interval_ms) == (128, 0.999, 0.8, 5, 200)


def test_config_section_env_refs_and_env_overrides():
    config = {"lora_affinity": {"redis_url": "os.environ/MY_REDIS", "kv_cache_threshold": 0.5}}
    env = {"MY_REDIS": "redis://r:6379/1", "LORA_AFFINITY_KV_CACHE_THRESHOLD": "0.7",
           "LORA_AFFINITY_SHEDDABLE_MODEL_GROUPS": "batch, offline"}
    s = settings_from_config(config, env)
    assert s.redis_url == "redis://r:6379/1"
    assert s.kv_cache_threshold == 0.7
    assert s.sheddable_model_groups == ["batch", "offline"]


@pytest.mark.parametrize("section,field,fragment", [
    ({"kv_cache_threshold": 1.5}, "kv_cache_threshold", "less than or equal to 1"),
    ({"lora_affinity_threshold": -0.1}, "lora_affinity_threshold", "greater than or equal to 0"),
    ({"queueing_threshold_lora": "many"}, "queueing_threshold_lora", "valid integer"),
    ({"scrape_interval_ms": 1}, "scrape_interval_ms", "greater than or equal to 10"),
    ({"rule_set": "round-robin"}, "rule_set", "is not a rule set; choose from: lora-affinity, lora-affinity-tree, lora-affinity-v1, gie-v0.2"),
    ({"redis_url": "http://x"}, "redis_url", "redis://"),
    ({"queue_treshold_critical": 3}, "queue_treshold_critical", "unknown setting"),
])
def test_bad_values_name_the_field_the_value_and_what_is_allowed(section, field, fragment):
    with pytest.raises(SettingsError) as err:
        build_settings(section, environ={})
    message = str(err.value)
    assert field in message and fragment in message


def test_missing_env_reference_is_named():
    with pytest.raises(SettingsError, match="NOPE_NOT_SET"):
        build_settings({"redis_url": "os.environ/NOPE_NOT_SET"}, environ={})


def test_passwords_never_appear_in_errors_or_redacted_urls():
    assert redact_url("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact_url("rediss://:s3cret@host:6380") == "rediss://***@host:6380"
    with pytest.raises(SettingsError) as err:
        build_settings({"redis_url": "redis://:s3cret@host", "kv_cache_threshold": 9}, environ={})
    assert "s3cret" not in str(err.value)
    assert Settings(redis_url="redis://:s3cret@h:1").redacted_redis_url() == "redis://***@h:1"


def test_no_password_survives_redaction_whatever_it_holds():
    """Generated passwords with the characters a URL gives meaning to (? / # @ : & =) in every URL form."""
    from hypothesis import given, settings as hsettings, strategies as st

    password = st.text(alphabet="abcXYZ019?/#@:&=%+ ", min_size=4, max_size=24).filter(lambda p: p.strip() != "")

    @hsettings(max_examples=300, deadline=None)
    @given(password=password, user=st.sampled_from(["", "u", "user"]),
           form=st.sampled_from(["redis://{c}@host:6379/0", "rediss://{c}@host:6380", "unix://{c}@/tmp/r.sock",
                                 "redis+sentinel://{c}@s1:26379,s2:26379/m/0?sentinel_password={p}",
                                 "redis+cluster://{c}@r0:6379,r1:6379", "redis://host:6379/0?password={p}"]))
    def check(password, user, form):
        secret = "Zq" + password + "Zq"  # a marker no URL part holds by chance
        url = form.format(c=f"{user}:{secret}", p=secret)
        assert secret not in redact_url(url), url

    check()


def test_model_group_overrides_are_validated_and_applied():
    s = build_settings({"model_group_overrides": {"batch": {"rule_set": "gie-v0.2", "kv_cache_threshold": 0.5}}},
                       environ={})
    assert s.for_group("batch").rule_set == "gie-v0.2" and s.for_group("batch").kv_cache_threshold == 0.5
    assert s.for_group("other") is s
    with pytest.raises(SettingsError, match="model_group_overrides.batch.kv_cache_threshold"):
        build_settings({"model_group_overrides": {"batch": {"kv_cache_threshold": 5}}}, environ={})
    with pytest.raises(SettingsError, match="model_group_overrides.batch.redis_url: not settable per model group"):
        build_settings({"model_group_overrides": {"batch": {"redis_url": "redis://x"}}}, environ={})


def test_unknown_rule_names_are_refused():
    with pytest.raises(SettingsError, match="disabled_rules"):
        build_settings({"disabled_rules": ["least_kv", "warp_drive"]}, environ={})


def test_sentinel_and_cluster_urls_are_parsed_into_their_parts():
    from lora_affinity_plugin.config.connection import parse_redis_url

    sentinel = parse_redis_url("redis+sentinel://u:p%40ss@s1:26379,s2:26380/mymaster/2?sentinel_password=sp")
    assert (sentinel.kind, sentinel.nodes, sentinel.service, sentinel.db) == (
        "sentinel", (("s1", 26379), ("s2", 26380)), "mymaster", 2)
    assert (sentinel.username, sentinel.password, sentinel.sentinel_password) == ("u", "p@ss", "sp")
    cluster = parse_redis_url("rediss+cluster://r0:6379,r1:6379")
    assert (cluster.kind, cluster.nodes, cluster.ssl, cluster.db) == ("cluster", (("r0", 6379), ("r1", 6379)), True, 0)
    assert parse_redis_url("redis://h:1/0").kind == "server"


@pytest.mark.parametrize("url, message", [
    ("redis+sentinel://s1:26379", "names the master's service"),
    ("redis+sentinel://s1/mymaster", "is not host:port"),
    ("redis+cluster://r0:6379/3", "a Cluster has only db 0"),
    ("redis+mesh://r0:6379", "must start with one of"),
    ("rediss+sentinel://s1:26379/m", "must start with one of"),
])
def test_bad_sentinel_and_cluster_urls_are_refused_with_the_reason(url, message):
    with pytest.raises(SettingsError) as err:
        build_settings({"redis_url": url}, environ={})
    assert "redis_url" in str(err.value) and message in str(err.value)


def test_sentinel_passwords_are_redacted_too():
    url = "redis+sentinel://u:s3cret@s1:26379/m/0?sentinel_password=t0p&socket_timeout=1"
    assert redact_url(url) == "redis+sentinel://u:***@s1:26379/m/0?sentinel_password=***&socket_timeout=1"
    with pytest.raises(SettingsError) as err:
        build_settings({"redis_url": "redis+sentinel://:s3cret@s1/m?sentinel_password=t0p"}, environ={})
    assert "s3cret" not in str(err.value) and "t0p" not in str(err.value)


def test_the_configuration_reference_is_generated_from_the_model_and_current():

    from lora_affinity_plugin.config.settings import Settings
    from lora_affinity_plugin.ops.settings_reference import render

    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == render(), "run: python -m lora_affinity_plugin.ops.settings_reference > docs/configuration.md"
    for name, field in Settings.model_fields.items():  # every setting documented, with what it does
        assert f"| `{name}` |" in page.read_text() and field.description, name


def test_the_docs_build_with_mkdocs_strict(tmp_path):
    """No broken link or anchor between the pages (mkdocs.yml: strict, anchors validated)."""
    import subprocess
    import sys

    root = ROOT
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_the_operating_pages_restart_only_list_is_the_models():
    import re

    from lora_affinity_plugin.config.settings import RESTART_ONLY

    page = (ROOT / "docs" / "operating.md").read_text()
    listed = page.split("Settings that need a restart", 1)[1].split("are refused at run time", 1)[0]
    assert set(re.findall(r"`([a-z_]+)`", listed)) == RESTART_ONLY, listed


def test_a_missing_unreadable_or_malformed_config_file_is_one_line_naming_it(tmp_path, capsys):
    from lora_affinity_plugin.ops import cli

    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    for path, said in ((tmp_path / "missing.yaml", "No such file"), (tmp_path, "Is a directory"), (bad, "not valid YAML")):
        for command in ("status", "scrape"):
            assert cli.main([command, "--config", str(path)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("error: ") and said in err and "Traceback" not in err, err


def test_an_unknown_setting_is_named_with_the_closest_names_not_a_list_of_all():
    with pytest.raises(SettingsError) as err:
        build_settings({"kv_cache_treshold": 0.7}, environ={})
    assert "kv_cache_treshold: unknown setting; did you mean 'kv_cache_threshold'" in str(err.value)
    assert "queue_threshold_critical" not in str(err.value)
    with pytest.raises(SettingsError, match="zzz: unknown setting; `lora-affinity thresholds show`"):
        build_settings({"zzz": 1}, environ={})
