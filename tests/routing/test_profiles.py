"""Rule sets as profiles of parts: a new rule is one class plus a settings line; bad profiles are refused by
name; the house has no import circle and no module reaches into another's private names."""

import ast
import random
import sys
import textwrap
from pathlib import Path

import pytest

from lora_affinity_plugin.routing.decision import PARTS, Scorer
from lora_affinity_plugin.config.live_settings import apply_live
from lora_affinity_plugin.routing.profiles import BUILT_IN, describe
from lora_affinity_plugin.routing.scheduling import Candidate, RouteRequest, choose_pod
from lora_affinity_plugin.config.settings import SettingsError, build_settings
from paths import ROOT

PACKAGE = ROOT / "src" / "lora_affinity_plugin"


def pod(key, waiting=0, running=0, kv=0.0, active=()):
    return Candidate(key, waiting, running, kv, frozenset(active), frozenset(), 4)


class FewestRunning(Scorer):
    """A toy rule: the fewest running requests, exactly (a test's own part: defining it registers it)."""

    name = "toy_fewest_running"

    def costs(self, pods, run):
        return [p.running for p in pods]


def test_a_new_rule_is_one_class_and_a_settings_line():
    settings = build_settings({"rule_set": "toy", "profiles": {"toy": ["low_queue", "toy_fewest_running", "pick"]}},
                              environ={})
    pods = [pod("a", running=5), pod("b", running=2), pod("c", running=3), pod("d", waiting=200, running=0)]
    decisions = [choose_pod(pods, RouteRequest("x"), settings, random.Random(seed)) for seed in range(20)]
    assert {d.pod for d in decisions} == {"b"}  # d runs least but its queue is over the low-queue threshold
    explained = choose_pod(pods, RouteRequest("x"), settings, random.Random(0), explain=True)
    steps = {rule: (out, values) for rule, out, values in explained.trace}
    assert steps["low_queue"][0] == ("a", "b", "c")
    assert steps["toy_fewest_running"] == (("b",), {"a": 5, "b": 2, "c": 3})  # each candidate's score, as explained


def test_weighted_scorers_and_a_built_in_rule_set_as_steps():
    """`{scorer: weight}` sums scorers; a rule set's name inlines its steps after a filter of yours."""
    weighted = build_settings({"rule_set": "w", "profiles": {"w": [{"toy_fewest_running": 1, "least_kv": 10}]}},
                              environ={})
    pods = [pod("a", running=1, kv=0.9), pod("b", running=3, kv=0.1)]
    assert choose_pod(pods, RouteRequest("x"), weighted, random.Random(0)).pod == "b"  # 1 + 9 against 3 + 1
    ours = build_settings({}, environ={})
    wrapped = build_settings({"rule_set": "wrapped", "profiles": {"wrapped": ["low_queue", "lora-affinity"]}},
                             environ={})
    rng = random.Random(3)
    for _ in range(50):
        pods = [pod(k, waiting=rng.randrange(4), running=rng.randrange(20), kv=rng.random(),
                    active=rng.sample(["x", "y", "z"], rng.randrange(3))) for k in "abcdef"]
        request = RouteRequest(rng.choice(["x", "y", None]), placement_key=rng.randrange(1 << 30))
        assert choose_pod(pods, request, wrapped, random.Random(1)) .pod == choose_pod(pods, request, ours,
                                                                                      random.Random(1)).pod


@pytest.mark.parametrize("profiles, fragment", [
    ({"p": ["low_queue", "lowest_queue"]}, "profiles.p[1]: unknown part or profile 'lowest_queue'; parts: "),
    ({"p": ["base_model"]}, "profiles.p[0]: 'base_model' is a condition"),
    ({"p": [{"low_queue": 1}]}, "profiles.p[0]: 'low_queue' is a filter; a weighted step takes scorers"),
    ({"p": ["q"], "q": ["p"]}, "includes itself (p -> q -> p)"),
    ({"gie-v0.2": ["pick"]}, "profiles.gie-v0.2: 'gie-v0.2' is a built-in rule set"),
    ({"p": []}, "profiles.p: a non-empty list of steps"),
])
def test_a_bad_profile_is_refused_with_its_name_and_step(profiles, fragment):
    with pytest.raises(SettingsError) as err:
        build_settings({"profiles": profiles}, environ={})
    assert fragment in str(err.value)


def test_an_unknown_rule_set_names_the_choices_including_your_profiles():
    with pytest.raises(SettingsError, match="rule_set: 'mine' is not a rule set; choose from: .*sglang-cache-aware, predicted-ttft, llmd-weights, llmd-precise, dynamo, llmd-affinity, aibrix-prefix, other"):
        build_settings({"rule_set": "mine", "profiles": {"other": ["pick"]}}, environ={})
    with pytest.raises(SettingsError, match=r"model_group_overrides.batch.*rule_set: 'nope' is not a rule set"):
        build_settings({"model_group_overrides": {"batch": {"rule_set": "nope"}}}, environ={})


def test_a_profile_is_set_live_and_a_bad_one_leaves_the_last_good_in_force():
    base = build_settings({}, environ={})
    live = apply_live(base, {"profiles": {"toy": ["toy_fewest_running", "pick"]}, "rule_set": "toy"})
    pods = [pod("a", running=4), pod("b", running=1)]
    assert live.rule_set == "toy" and choose_pod(pods, RouteRequest("x"), live, random.Random(0)).pod == "b"
    with pytest.raises(SettingsError, match="unknown part or profile 'nope'"):
        apply_live(live, {"profiles": {"toy": ["nope"]}})
    assert live.built_profiles()["toy"]  # (settings are immutable: the good copy stands)


def test_rule_modules_are_imported_so_their_parts_can_be_named(tmp_path, monkeypatch):
    (tmp_path / "my_rules.py").write_text(textwrap.dedent('''
        from lora_affinity_plugin import Filter  # the public API

        class OnlyEven(Filter):
            """Pods whose key ends in an even digit."""
            name = "toy_only_even"

            def keep(self, pods, run):
                return [p for p in pods if int(p.key[-1]) % 2 == 0]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = build_settings({"rule_modules": ["my_rules"], "rule_set": "even",
                               "profiles": {"even": ["toy_only_even", "least_load", "pick"]}}, environ={})
    assert choose_pod([pod("p1"), pod("p2", running=9)], RouteRequest("x"), settings, random.Random(0)).pod == "p2"
    with pytest.raises(SettingsError, match="rule_modules: cannot import 'no_such_rules': ModuleNotFoundError"):
        build_settings({"rule_modules": ["no_such_rules"]}, environ={})
    PARTS.pop("toy_only_even")
    sys.modules.pop("my_rules")


def test_every_built_in_rule_set_is_described_part_by_part():
    for name, steps in BUILT_IN.items():
        lines = describe(steps)
        assert lines and lines[-1].strip(), name
    text = "\n".join(describe(BUILT_IN["lora-affinity-tree"]))
    assert "if base_model:" in text and "least_cost  [scorer]" in text and "pick_placement" in text
    default = "\n".join(describe(BUILT_IN["lora-affinity"]))
    branches = [line.strip() for line in default.splitlines() if line.lstrip().startswith("if ")]
    assert "predicted_ttft  [scorer]" in default  # one estimate; the only branches deal adapters among gateways
    assert branches == ["if dealt_while_slots_scarce:", "if dealt_new_adapter:"]
    assert BUILT_IN["lora-affinity"] == BUILT_IN["predicted-ttft"]


LAYERS = ["telemetry", "kv", "routing", "config", "fleet", "scraping", "host", "ops"]
"""The package's folders, bottom up: a module may import its own folder and the folders below it, never one above;
the entry points at the top (`strategy.py`, `scraper.py`, `__init__.py`) may import any."""
LAYER_OF = {name: i for i, name in enumerate(LAYERS)}


def _module_name(path: Path) -> str:
    """`kv.exact_index`, `strategy`: a module's name under the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def _plugin_imports(path: Path) -> tuple[set[str], list[str]]:
    """Every plugin module `path` imports, wherever the import stands (top level, inside a function, under
    TYPE_CHECKING), as names under the package, and every private name it imports from another module."""
    package = list(path.parent.relative_to(PACKAGE).parts)
    tree = ast.parse(path.read_text())
    modules, private = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.split(".")[0] == "lora_affinity_plugin":
                target = node.module.partition(".")[2]
            else:
                continue
            if node.module:
                modules.add(target)
                private += [f"{target}.{a.name}" for a in node.names if a.name.startswith("_")]
            else:  # from . import x
                modules |= {f"{target}.{a.name}".strip(".") for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.name.partition(".")[2] for a in node.names if a.name.startswith("lora_affinity_plugin.")}
    modules.discard(_module_name(path))
    return modules, private


def test_the_house_has_no_import_circle_no_private_imports_and_its_folders_are_its_layers():
    """Every import counts (a function-local or TYPE_CHECKING one is a dependency too): no circle, no private name
    taken from another module, and each folder imports only its own and the folders below it."""
    graph, private = {}, []
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        graph[name], found = _plugin_imports(path)
        private += [f"{name}: {taken}" for taken in found]
    assert not private, private
    assert set(graph) >= {f"{folder}" for folder in LAYERS} | {"strategy", "scraper", "__init__"}
    folders = {name.split(".")[0] for name in graph if "." in name}
    assert folders == set(LAYERS), folders  # a new folder takes its place in LAYERS
    done, visiting = set(), []

    def visit(module):
        if module in done:
            return
        assert module not in visiting, " -> ".join([*visiting[visiting.index(module):], module])
        visiting.append(module)
        for dependency in graph.get(module, ()):
            visit(dependency)
        visiting.pop()
        done.add(module)

    for module in graph:
        visit(module)
    upward = [f"{module} imports {dependency}" for module, dependencies in graph.items() if "." in module
              for dependency in dependencies
              if LAYER_OF.get(dependency.split(".")[0], len(LAYERS)) > LAYER_OF[module.split(".")[0]]]
    assert not upward, upward
    assert all(dependency.split(".")[0] in LAYER_OF for dependencies in graph.values() for dependency in dependencies)
    # Within the scheduling core: the data the parts read sits below the rules.
    assert not graph["routing.podstate"] and "routing.decision" not in graph["routing.rates"]


def test_the_rules_command_lists_the_config_s_profiles_and_prints_one_step_by_step(tmp_path):
    from procs import run_cli

    config = tmp_path / "config.yaml"
    config.write_text("lora_affinity:\n  rule_set: kv-first\n  profiles:\n"
                      "    kv-first: [low_queue, {least_kv: 2, least_load: 1}, pick]\n")
    listed = run_cli(["rules", "--config", str(config)])
    assert "kv-first (in force: kv-first)" in listed and "scorers: " in listed and "least_cost" in listed
    shown = run_cli(["rules", "kv-first", "--config", str(config)])
    assert shown.splitlines() == ["kv-first:", "  low_queue  [filter]", "  {least_kv: 2, least_load: 1}  [scorer]",
                                  "  pick  [picker]"]


def test_weights_must_be_finite_and_non_negative_steps_after_a_picker_are_refused_and_scores_can_be_disabled():
    for weight in (float("nan"), float("inf"), -1):
        with pytest.raises(SettingsError, match=r"profiles\.mine\[0\]\.least_load: a finite number at least 0"):
            build_settings({"rule_set": "mine", "profiles": {"mine": [{"least_load": weight}, "pick"]}}, environ={})
    for steps, position in ((["pick", "least_load"], 1), (["llmd-prefix", "pick"], 1), (["least_load", "pick", "pick"], 2)):
        with pytest.raises(SettingsError, match=rf"profiles\.mine\[{position}\]: unreachable"):
            build_settings({"rule_set": "mine", "profiles": {"mine": steps}}, environ={})
    build_settings({"disabled_rules": ["scores"]}, environ={})  # what a weighted step declares


def test_filters_that_read_a_survey_find_their_input_alone_in_a_profile_of_the_settings():
    settings = build_settings({"rule_set": "mine", "profiles": {"mine": ["prefix_match", "pick"],
                                                                 "adapters": ["adapter_active", "pick"],
                                                                 "deal": ["dealt", "pick"]}}, environ={})
    pods = [Candidate(f"p{i}", 0, 1, 0.1, frozenset({"sql"} if i == 2 else ()), max_lora=4) for i in range(3)]
    held = RouteRequest(None, prefix_blocks=10, prefix_matches={"p1": 10})
    assert {choose_pod(pods, held, settings, random.Random(i)).pod for i in range(20)} == {"p1"}
    adapters = settings.model_copy(update={"rule_set": "adapters"})
    assert {choose_pod(pods, RouteRequest("sql"), adapters, random.Random(i)).pod for i in range(20)} == {"p2"}
    deal = settings.model_copy(update={"rule_set": "deal"})
    dealt = RouteRequest("sql", home="p0", gateways=2)
    assert {choose_pod(pods, dealt, deal, random.Random(i)).pod for i in range(20)} == {"p0"}


def test_the_peers_references_llmd_precise_and_dynamo_choose_as_their_formulas_say():
    from lora_affinity_plugin.config.settings import build_settings as bs

    pods = [Candidate("holder", 0, 4, 0.9, frozenset(), kv_free_tokens=1_000, kv_cache_tokens=10_000),
            Candidate("empty", 0, 0, 0.0, frozenset(), kv_free_tokens=10_000, kv_cache_tokens=10_000)]
    request = RouteRequest(None, prefix_blocks=50, prefix_matches={"holder": 50})
    # Dynamo: holder 0 blocks to prefill + 9,000 tokens held (140.6 blocks of 64) against 50 + 0: the empty pod
    assert choose_pod(pods, request, bs({"rule_set": "dynamo"}, environ={}), random.Random(1)).pod == "empty"
    # llm-d's precise profile: prefix 2 x 1.0 outweighs KV 1 x 0.9 (queues equal): the holder
    assert choose_pod(pods, request, bs({"rule_set": "llmd-precise"}, environ={}), random.Random(1)).pod == "holder"


def test_the_peers_references_llmd_affinity_and_aibrix_prefix_choose_as_their_rules_say():
    from lora_affinity_plugin.config.settings import build_settings as bs

    affinity, aibrix = bs({"rule_set": "llmd-affinity"}, environ={}), bs({"rule_set": "aibrix-prefix"}, environ={})
    pods = [Candidate("holder", 3, 4, 0.9, frozenset()), Candidate("idle", 0, 0, 0.0, frozenset()),
            Candidate("half", 0, 1, 0.1, frozenset())]
    held = RouteRequest(None, prefix_blocks=50, prefix_matches={"holder": 45, "half": 25})
    # llm-d: 90% held makes the holder sticky; its start (no tokens in flight) is not 18 s behind: it keeps it
    assert {choose_pod(pods, held, affinity, random.Random(i)).pod for i in range(10)} == {"holder"}
    # ... until it is computing 20 s of prompts (at 15,928 tokens/s), while the others are free: the least token load
    busy = RouteRequest(None, prefix_blocks=50, prefix_matches={"holder": 45, "half": 25},
                        prefilling={"holder": 20 * 15_928 * 0.0002 + 1})
    assert choose_pod(pods, busy, affinity, random.Random(1)).pod in {"idle", "half"}
    # AIBrix: loads within 16 of each other: the longest match, within the mean + 2 sd
    assert {choose_pod(pods, held, aibrix, random.Random(i)).pod for i in range(10)} == {"holder"}
    # ... more than 16 apart: the least loaded, whatever it holds
    crowded = [Candidate("holder", 20, 4, 0.9, frozenset()), *pods[1:]]
    assert {choose_pod(crowded, held, aibrix, random.Random(i)).pod for i in range(10)} == {"idle"}
