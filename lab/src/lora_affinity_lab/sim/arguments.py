"""`lora-affinity sim`'s options, apart from the server so that the CLI builds them without its imports."""

from __future__ import annotations

import argparse


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=6)
    parser.add_argument("--base-port", type=int, default=8100, help="replica i listens on base-port + i")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--speed", type=float, default=1.0, help="K times faster than real time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--max-cpu-loras", type=int, default=12)
    parser.add_argument("--kv-blocks", type=int, default=700)
    parser.add_argument("--kv-metric-name", choices=["kv_cache_usage_perc", "gpu_cache_usage_perc"],
                        default="kv_cache_usage_perc")
    parser.add_argument("--adapters", help="comma-separated adapter names to serve (default: any name)")
    parser.add_argument("--warm-adapters", help="comma-separated adapters already loaded (GPU slots filled round-robin)")
    parser.add_argument("--base-model", default="meta-llama/Llama-2-7b-hf")
    parser.add_argument("--metrics-token", help="require `Authorization: Bearer TOKEN` on /metrics")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 (vLLM's --api-key)")
    parser.add_argument("--min-output-tokens", type=int, default=1, help="floor of the drawn output length")
    parser.add_argument("--mean-output-tokens", type=float, default=580.0,
                        help="mean of the drawn output length (exponential, capped by max_tokens)")
    parser.add_argument("--residency-metric", action="store_true",
                        help="expose vllm:lora_adapter_loaded{adapter_name,level} (proposed upstream)")
    parser.add_argument("--keep-alive-s", type=float, default=5.0,
                        help="close connections idle this long (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, default 5)")
    parser.add_argument("--lora-info-style", choices=["legacy", "current"], default="legacy",
                        help="current: vLLM after PR #26801 (every active adapter in both lists of "
                             "lora_requests_info, vllm:max_gpu_lora_adapters, pinned on lora_adapter_loaded)")
    parser.add_argument("--sglang-replicas", default="",
                        help="comma-separated replica indices whose /metrics use SGLang's names (a mixed fleet)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="turn off automatic prefix caching (on by default, as in vLLM's V1 engine)")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="context length: a longer prompt + max_tokens gets HTTP 400, as from vLLM")
    parser.add_argument("--replica-profiles", default="",
                        help="replicas of different speeds and sizes: profiles separated by ';', each "
                             "KEY=VALUE,... of " + ", ".join(PROFILE_KEYS) + ", dealt to the replicas in turn, "
                             "e.g. 'speed=1;speed=0.5,kv_blocks=350' (half the replicas at half speed and cache)")
    parser.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                        help="tokenize prompts with this Hugging Face tokenizer.json (default: 3 bytes a token)")
    parser.add_argument("--kv-events-config", metavar="JSON",
                        help="publish KV-cache events as vLLM does, e.g. '{\"enable_kv_cache_events\": true, "
                             "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
                             "\"tcp://*:6557\"}'; replica i adds i to each port")
    parser.add_argument("--kv-events-layout", choices=["map", "array"], default="map",
                        help="map: vLLM's current encoding; array: older releases'")
    parser.set_defaults(func=_run_sim)


PROFILE_KEYS = {"speed": float, "kv_blocks": int, "max_loras": int, "max_num_seqs": int}
"""What a replica profile may set (EngineConfig fields)."""


def parse_profiles(spec: str) -> list[dict]:
    """`'speed=1;speed=0.5,kv_blocks=350'` -> [{'speed': 1.0}, {'speed': 0.5, 'kv_blocks': 350}]."""
    profiles = []
    for part in filter(None, (p.strip() for p in (spec or "").split(";"))):
        profile = {}
        for item in filter(None, (i.strip() for i in part.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in PROFILE_KEYS:
                raise SystemExit(f"--replica-profiles: {item!r} is not KEY=VALUE with KEY one of {', '.join(PROFILE_KEYS)}")
            try:
                value = PROFILE_KEYS[key](raw)
            except ValueError:
                raise SystemExit(f"--replica-profiles: {key}={raw!r} is not a number") from None
            if value <= 0 or key == "speed" and value > 100:
                raise SystemExit(f"--replica-profiles: {key} must be positive" + (" and at most 100" if key == "speed" else ""))
            profile[key] = value
        profiles.append(profile)
    return profiles


def _run_sim(args: argparse.Namespace) -> int:
    from .server import run_sim

    return run_sim(args)
