"""lora-affinity-plugin: LiteLLM's routing strategy for fleets of vLLM replicas serving LoRA adapters.

Entry points: `lora_affinity_plugin.strategy` (what `config.yaml` names: `strategy.proxy_plugin`) and
`lora_affinity_plugin.scraper` (the worker `lora-affinity scrape` runs). The layers, each a folder, bottom up:
`telemetry` and `kv`, then `routing` (the pure scheduling core), `config`, `fleet` (Redis and a proxy's view of
its pods), `scraping`, `host` (the adapter to LiteLLM) and `ops` (the command line).

The public API is what this module exports: the settings, and the parts a custom rule subclasses
(docs/routing.md, "Rule sets"). Everything else is internal and may move between releases.
"""

from .config.settings import Settings, SettingsError, build_settings
from .routing.decision import (
           Candidate,
           Condition,
           DecisionRun,
           Filter,
           Picker,
           RouteRequest,
           Scorer,
)

__all__ = ["Candidate", "Condition", "DecisionRun", "Filter", "Picker", "RouteRequest", "Scorer", "Settings",
           "SettingsError", "build_settings"]
