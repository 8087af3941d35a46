"""Live settings: validation of every kind of bad input, compare-and-set, audit, and followers that
refuse a bad value in Redis and keep the last good settings."""

import json

import fakeredis
import pytest

from lora_affinity_plugin.config import live_settings as ls
from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.fleet.follower import Follower
from lora_affinity_plugin.telemetry.metrics import SETTINGS_REJECTED
from lora_affinity_plugin.config.settings import SettingsError, build_settings

BASE = build_settings({}, environ={})


@pytest.fixture
def client():
    return fakeredis.FakeRedis()


BAD_SETS = [
    (["kv_cache_threshold=1.5"], "kv_cache_threshold", "less than or equal to 1"),
    (["kv_cache_threshold=-0.1"], "kv_cache_threshold", "greater than or equal to 0"),
    (["kv_cache_threshold=high"], "kv_cache_threshold", "valid number"),
    (["lora_affinity_threshold=2"], "lora_affinity_threshold", "less than or equal to 1"),
    (["lora_affinity_threshold=-1"], "lora_affinity_threshold", "greater than or equal to 0"),
    (["queueing_threshold_lora=-5"], "queueing_threshold_lora", "greater than or equal to 0"),
    (["queueing_threshold_lora=1.5"], "queueing_threshold_lora", "valid integer"),
    (["queueing_threshold_lora=[1]"], "queueing_threshold_lora", "valid integer"),
    (["queue_threshold_critical=-1"], "queue_threshold_critical", "greater than or equal to 0"),
    (["queue_threshold_critical=lots"], "queue_threshold_critical", "valid integer"),
    (["scrape_interval_ms=1"], "scrape_interval_ms", "greater than or equal to 10"),
    (["scrape_interval_ms=999999"], "scrape_interval_ms", "less than or equal to 60000"),
    (["stale_after_ms=50000"], "stale_after_ms", "must not exceed metrics_ttl_ms"),
    (["metrics_ttl_ms=100"], "stale_after_ms", "must not exceed metrics_ttl_ms"),
    (["rule_set=round-robin"], "rule_set", "choose from: lora-affinity, lora-affinity-tree, lora-affinity-v1, gie-v0.2"),
    (["shedding=maybe"], "shedding", "valid boolean"),
    (["count_dispatches=2"], "count_dispatches", "valid boolean"),
    (["residency_memory=0"], "residency_memory", "greater than or equal to 1"),
    (["spill_queue_margin=-3"], "spill_queue_margin", "greater than or equal to 0"),
    (["sheddable_model_groups=5"], "sheddable_model_groups", "valid list"),
    (["dispatch_lag_ms=-1"], "dispatch_lag_ms", "greater than or equal to 0"),
    (["no_such_setting=1"], "no_such_setting", "unknown setting"),
    (["redis_url=redis://elsewhere"], "redis_url", "cannot change at run time"),
    (["key_prefix=other"], "key_prefix", "cannot change at run time"),
    (["kv_cache_threshold"], "kv_cache_threshold", "expected key=value"),
    (["=3"], "=3", "expected key=value"),
]


@pytest.mark.parametrize("pairs,field,fragment", BAD_SETS, ids=[b[0][0] for b in BAD_SETS])
def test_bad_set_is_refused_with_field_and_nothing_changes(client, pairs, field, fragment):
    ls.write(client, BASE, {"kv_cache_threshold": 0.7}, "setup")
    before = client.get(ls.settings_key(BASE.key_prefix))
    with pytest.raises(SettingsError) as err:
        ls.write(client, BASE, ls.parse_assignments(pairs), "mallory")
    assert field in str(err.value) and fragment in str(err.value)
    assert client.get(ls.settings_key(BASE.key_prefix)) == before
    assert len(ls.history(client, BASE.key_prefix)) == 1


def test_a_change_is_versioned_and_audited(client):
    _, v1 = ls.write(client, BASE, {"kv_cache_threshold": 0.7}, "alice")
    _, v2 = ls.write(client, BASE, {"queue_threshold_critical": 3, "kv_cache_threshold": 0.7}, "bob")
    assert (v1.version, v2.version) == (1, 2)
    newest, oldest = ls.history(client, BASE.key_prefix)
    assert oldest["by"] == "alice" and oldest["old"] == {"kv_cache_threshold": 0.8} and oldest["new"] == {"kv_cache_threshold": 0.7}
    assert newest["by"] == "bob" and newest["new"] == {"queue_threshold_critical": 3}


def test_a_write_that_changes_nothing_makes_no_version_and_no_audit_entry(client):
    ls.write(client, BASE, {"kv_cache_threshold": 0.7}, "alice")
    old, new = ls.write(client, BASE, {"kv_cache_threshold": 0.7}, "bob")
    assert old is new and new.version == 1 and len(ls.history(client, BASE.key_prefix)) == 1
    ls.write(client, BASE, ls.live_values(BASE), "carol")  # a reset
    ls.write(client, BASE, ls.live_values(BASE), "carol")  # and again: nothing to record
    assert ls.read(client, BASE.key_prefix).version == 2 and len(ls.history(client, BASE.key_prefix)) == 2


def test_racing_writers_one_wins_the_other_is_told(client):
    ls.write(client, BASE, {"kv_cache_threshold": 0.7}, "setup")
    ls.write(client, BASE, {"kv_cache_threshold": 0.6}, "alice", if_version=1)
    with pytest.raises(ls.ConflictError, match="version 2, not 1"):
        ls.write(client, BASE, {"kv_cache_threshold": 0.5}, "bob", if_version=1)
    assert ls.read(client, BASE.key_prefix).values["kv_cache_threshold"] == 0.6


def test_seed_only_when_redis_has_none(client):
    assert ls.seed(client, BASE, "proxy") is True
    ls.write(client, BASE, {"kv_cache_threshold": 0.5}, "ops")
    assert ls.seed(client, BASE, "proxy") is False
    assert ls.read(client, BASE.key_prefix).values["kv_cache_threshold"] == 0.5
    assert ls.seed(client, BASE, "proxy", force=True) is True
    assert ls.read(client, BASE.key_prefix).values["kv_cache_threshold"] == 0.8


def good(version, **values):
    return json.dumps({"version": version, "values": {**ls.live_values(BASE), **values}, "by": "t"}).encode()


HAND_WRITTEN = [
    b"not json",
    b"[1, 2]",
    json.dumps({"values": {}}).encode(),
    json.dumps({"version": "7", "values": {}}).encode(),
    json.dumps({"version": 0, "values": {}}).encode(),
    json.dumps({"version": 9, "values": "kv=0.1"}).encode(),
    good(9, kv_cache_threshold=3),
    good(9, queueing_threshold_lora="many"),
    good(9, rule_set="fastest"),
    good(9, redis_url="redis://evil:6379"),
    good(9, stale_after_ms=99999),
    good(9, scrape_interval_ms=0),
]


@pytest.mark.parametrize("raw", HAND_WRITTEN, ids=range(len(HAND_WRITTEN)))
def test_follower_refuses_a_bad_hand_written_value_and_keeps_the_last_good(raw):
    applied = []
    follower = Follower(BASE, FleetView(BASE), lambda: [], applied.append)
    follower._follow_settings(good(3, kv_cache_threshold=0.6))
    assert follower.live.version == 3 and applied[-1].kv_cache_threshold == 0.6
    rejected = SETTINGS_REJECTED._value.get()
    follower._follow_settings(raw)
    follower._follow_settings(raw)  # the same bad value is counted and logged once
    assert follower.live.version == 3 and follower.settings.kv_cache_threshold == 0.6 and len(applied) == 1
    assert SETTINGS_REJECTED._value.get() == rejected + 1
    follower._follow_settings(good(10, kv_cache_threshold=0.5))  # a later good version still applies
    assert follower.live.version == 10 and applied[-1].kv_cache_threshold == 0.5


def test_a_newer_versions_settings_are_left_out_by_followers_and_carried_by_writers(client):
    """A rolling upgrade: a newer proxy's CLI wrote a name this version does not know."""
    applied = []
    follower = Follower(BASE, FleetView(BASE), lambda: [], applied.append)
    follower._follow_settings(good(4, kv_cache_threshold=0.4, future_knob={"x": 1}))
    assert follower.live.version == 4 and applied[-1].kv_cache_threshold == 0.4
    client.set(ls.settings_key(BASE.key_prefix), good(4, kv_cache_threshold=0.4, future_knob={"x": 1}))
    _, new = ls.write(client, BASE, {"kv_cache_threshold": 0.3}, "old-cli")
    assert new.values["future_knob"] == {"x": 1} and new.values["kv_cache_threshold"] == 0.3
    with pytest.raises(SettingsError, match="future_knob: unknown setting"):
        ls.write(client, BASE, {"future_knob": 2}, "old-cli")  # but never writes a name it does not know


def test_a_settings_file_that_cannot_be_applied_is_named_with_why(tmp_path):
    import pytest

    from lora_affinity_plugin.config.live_settings import read_file
    from lora_affinity_plugin.config.settings import SettingsError

    cases = {"missing.yaml": None, "broken.yaml": "queue_threshold_critical: [3\n", "empty.yaml": "",
             "list.yaml": "- queue_threshold_critical: 3\n"}
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(SettingsError, match=name):
            read_file(str(path))
    section = tmp_path / "section.yaml"
    section.write_text("lora_affinity:\n  kv_cache_threshold: 0.7\n")
    assert read_file(str(section)) == {"kv_cache_threshold": 0.7}


def test_after_redis_loses_its_data_proxies_follow_the_new_history_from_version_1():
    """A proxy that applied version 8 skips older versions of the same history, but a copy seeded afresh (a new
    epoch: Redis restarted without persistence) is applied, with a warning, and its later versions followed."""
    from lora_affinity_plugin.fleet.view import FleetView
    from lora_affinity_plugin.fleet.follower import Follower

    applied = []
    proxy = Follower(BASE, FleetView(BASE), lambda: [], applied.append)
    old = ls.LiveCopy(8, {**ls.live_values(BASE), "kv_cache_threshold": 0.6}, 1.0, "alice", "history-a")
    proxy._follow_settings(old.to_json().encode())
    assert proxy.settings.kv_cache_threshold == 0.6
    stale = ls.LiveCopy(7, {**ls.live_values(BASE), "kv_cache_threshold": 0.5}, 2.0, "alice", "history-a")
    proxy._follow_settings(stale.to_json().encode())
    assert proxy.settings.kv_cache_threshold == 0.6  # the same history's older copy is skipped
    client = fakeredis.FakeRedis()  # a wiped Redis: seeded, then changed
    assert ls.seed(client, BASE, "proxy")
    ls.write(client, BASE, {"kv_cache_threshold": 0.79}, "bob")
    fresh = client.get(ls.settings_key(BASE.key_prefix))
    assert ls.LiveCopy.from_json(fresh).version == 2
    proxy._follow_settings(fresh)
    assert proxy.settings.kv_cache_threshold == 0.79 and proxy.live.version == 2 and len(applied) == 2


def test_a_rollback_restores_an_earlier_versions_values_as_a_new_version(client):
    ls.seed(client, BASE, "setup")
    ls.write(client, BASE, {"kv_cache_threshold": 0.7}, "alice")                      # v2
    ls.write(client, BASE, {"queue_threshold_critical": 3}, "bob")                    # v3
    ls.write(client, BASE, {"kv_cache_threshold": 0.6, "spill_queue_margin": 4}, "carol")  # v4
    current = ls.read(client, BASE.key_prefix)
    at2 = ls.values_at(client, BASE.key_prefix, current, 2)
    assert (at2["kv_cache_threshold"], at2["queue_threshold_critical"], at2["spill_queue_margin"]) == (
        0.7, BASE.queue_threshold_critical, BASE.spill_queue_margin)
    assert ls.values_at(client, BASE.key_prefix, current, 4) == current.values
    with pytest.raises(SettingsError, match="version 9 is not between 1 and the current 4"):
        ls.values_at(client, BASE.key_prefix, current, 9)


def test_the_rollback_command_writes_a_version_with_the_old_values_and_says_where_from(tmp_path, capsys,
                                                                                        monkeypatch):
    from lora_affinity_plugin.ops import cli, commands as ops

    shared = fakeredis.FakeRedis()
    ls.seed(shared, BASE, "setup")
    ls.write(shared, BASE, {"kv_cache_threshold": 0.7}, "alice")
    ls.write(shared, BASE, {"kv_cache_threshold": 0.5}, "bob")
    config = tmp_path / "config.yaml"
    config.write_text("lora_affinity: {}\n")
    monkeypatch.setattr(ops, "_context", lambda args: (BASE, {}, shared))
    assert cli.main(["thresholds", "rollback", "2", "--by", "dave", "--config", str(config)]) == 0
    assert "version 4: kv_cache_threshold 0.5 -> 0.7" in capsys.readouterr().out
    (entry,) = ls.history(shared, BASE.key_prefix, count=1)
    assert entry["by"] == "dave" and entry["source"] == "rollback to version 2"


def test_show_says_a_hand_written_copy_the_proxies_refuse_is_not_in_force(tmp_path, capsys, monkeypatch):
    from lora_affinity_plugin.ops import cli, commands as ops

    shared = fakeredis.FakeRedis()
    bad = ls.LiveCopy(3, {**ls.live_values(BASE), "queue_threshold_critical": -7}, 1.0, "by hand")
    shared.set(ls.settings_key(BASE.key_prefix), bad.to_json())
    monkeypatch.setattr(ops, "_context", lambda args: (BASE, {}, shared))
    config = tmp_path / "config.yaml"
    config.write_text("lora_affinity: {}\n")
    assert cli.main(["thresholds", "show", "--config", str(config)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("version 3 REFUSED by every proxy") and "queue_threshold_critical" in first
