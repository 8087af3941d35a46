"""The plugin's own part of a decision, for whichever version of the package is on PYTHONPATH.

`lora-affinity bench --scenario decisions` imports helpers that older versions lack, so it cannot time them.
This loop uses only what every version has (`LoraAffinityStrategy.pick`, `FleetView.update`, `PodRecord`,
`PodMetrics`), with the benchmark's workload: 64 wildcard deployments, 24 adapters, 16 shared 16 KB system
prompts each with its own question, new strings for every request (as a proxy parsing JSON has), the records
renewed every 200 decisions. `side_by_side.sh` runs it for several commits in turn, in one sitting.

    PYTHONPATH=<checkout>/src python bench-tools/decision_own_part.py [DECISIONS]   # "median / p99" in us
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import random
import statistics
import time
import warnings

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
warnings.simplefilter("ignore")

import litellm  # noqa: E402



def _module(*names: str):
    """The first of `names` this version has: since the package's folders, `fleet.view`; before, `fleet`."""
    for name in names:
        try:
            return importlib.import_module(f"lora_affinity_plugin.{name}")
        except ImportError:
            continue
    raise ImportError(names)


FleetView = _module("fleet.view", "fleet").FleetView
discover_pods = _module("fleet.pods", "pods").discover_pods
PodMetrics = getattr(_module("routing.podstate", "podstate", "scheduling"), "PodMetrics")
build_settings = _module("config.settings", "settings").build_settings
PodRecord = _module("fleet.store", "store").PodRecord
LoraAffinityStrategy = _module("strategy").LoraAffinityStrategy

DEPLOYMENTS = 64
PROMPT_CHARS = 16384
ADAPTERS = [f"adapter-{i}" for i in range(24)]
_METRIC_FIELDS = {f.name for f in dataclasses.fields(PodMetrics)}


def _model_list() -> list[dict]:
    return [{"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_key": "none",
                                                   "api_base": f"http://10.0.{i // 250}.{i % 250}:8000/v1"}}
            for i in range(DEPLOYMENTS)]


def _records(pods: list[str], rng: random.Random) -> dict[str, PodRecord]:
    now, out = time.time(), {}
    for pod in pods:
        fields = dict(num_requests_waiting=rng.randrange(20), num_requests_running=rng.randrange(30),
                      kv_cache_usage=rng.random(), running_lora_adapters=frozenset(rng.sample(ADAPTERS, 3)),
                      waiting_lora_adapters=frozenset(rng.sample(ADAPTERS, 1)), max_lora=4, num_gpu_blocks=7000,
                      block_size=16)  # fields a version lacks are left out
        out[pod] = PodRecord(pod=pod, scraped_at=now,
                             metrics=PodMetrics(**{k: v for k, v in fields.items() if k in _METRIC_FIELDS}))
    return out


class _Prompts:
    def __init__(self, rng: random.Random) -> None:
        self.rng, self.question, self.count = rng, 512, 0
        self.systems = ["".join(rng.choice("abcdefghij klmnop") for _ in range(PROMPT_CHARS - 512)) for _ in range(16)]

    def next(self) -> list[dict]:
        self.count += 1
        question = (f"question {self.count} " * (self.question // 10 + 1))[: self.question]
        system = self.rng.choice(self.systems)
        return [{"role": "system", "content": system[:1] + system[1:]}, {"role": "user", "content": question}]


def main(decisions: int = 10_000, warmup: int = 2_000, seed: int = 1) -> None:
    import lora_affinity_plugin

    wanted = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    imported = lora_affinity_plugin.__file__
    assert not wanted or imported.startswith(os.path.abspath(wanted)), imported  # the version asked for
    rng, prompts = random.Random(seed), _Prompts(random.Random(seed))
    settings = build_settings({})
    router = litellm.Router(model_list=_model_list(), routing_strategy="simple-shuffle")
    fleet = FleetView(settings)
    strategy = LoraAffinityStrategy(router, settings, rng=random.Random(seed), fleet=fleet)
    healthy = router.model_list
    pods = discover_pods(healthy)
    samples = []
    for i in range(warmup + decisions):
        if i % 200 == 0:  # what the background refresher does every interval
            fleet.update(_records(pods, rng))
        model, messages = ADAPTERS[rng.randrange(len(ADAPTERS))], prompts.next()
        start = time.perf_counter_ns()
        strategy.pick(model, healthy, {"metadata": {}}, messages)
        samples.append(time.perf_counter_ns() - start)
    timed = sorted(samples[warmup:])
    print(f"{statistics.median(timed) / 1000:.1f} / {timed[int(len(timed) * 0.99)] / 1000:.0f}"
          f"  (fallbacks {strategy.fallbacks})")


if __name__ == "__main__":
    import sys

    main(*(int(arg) for arg in sys.argv[1:2]))
