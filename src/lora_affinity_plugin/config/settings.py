"""The plugin's one configuration object.

Every knob has one name, used alike in the `lora_affinity:` section of the proxy's
`config.yaml`, in `LORA_AFFINITY_<NAME>` environment variables and (later) in Redis.
Validation happens once, here; the rest of the code trusts a `Settings` instance.
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from .connection import SCHEMES, parse_redis_url

ENV_PREFIX = "LORA_AFFINITY_"
MAX_DATA_PARALLEL_RANKS = 64
"""The most data-parallel ranks a pod's KV events are followed for (`kv_events_data_parallel_size`)."""
# Per-model-group overrides may change how a group is routed, not where Redis is or how pods are scraped.
GROUP_SETTINGS = ("enabled", "shadow", "queueing_threshold_lora", "lora_affinity_threshold", "kv_cache_threshold", "queue_threshold_critical",
                  "rule_set", "spill_queue_margin", "cost_band_ms", "cost_band_ratio", "band_width", "disabled_rules", "shedding",
                  "prefix_affinity", "prefix_queue_margin", "prefix_queue_ratio", "prefix_min_blocks", "prefix_isolation")


class SettingsError(ValueError):
    """A setting failed validation; the message names the field, the value and what is allowed."""


class Settings(BaseModel):
    """Routing thresholds, scraping cadence and where Redis lives."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    # Where the shared state lives.
    redis_url: str = "redis://localhost:6379/0"
    """Where pod records live: `redis://`, `rediss://`, `unix://`, `redis+sentinel://host:port[,host:port]/service[/db]`,
    `redis+cluster://host:port[,host:port]`; passwords are never logged."""
    key_prefix: str = Field("lora_affinity", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    """Redis keys are `{key_prefix}:...`, so several gateways can share one Redis."""

    # Scraping.
    scrape_interval_ms: int = Field(200, ge=10, le=60_000)
    """How often the scraper reads every `/metrics`, and the proxies refresh their view."""
    scrape_timeout_ms: int = Field(1_000, ge=10, le=60_000)
    """Per-page fetch timeout; also the socket timeout of every Redis call the scraper and the proxies make (a
    slow Redis makes the plugin fall back, never hold a request)."""
    max_page_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Bigger pages mark the pod as failing."""
    metrics_path: str = "/metrics"
    """The path of each pod's metrics page."""
    metrics_bearer_token: SecretStr | None = None
    """Sent as `Authorization: Bearer ...` to the /metrics of the pods `metrics_token_pods` names (vLLM behind
    an auth proxy), and to no other api_base; never logged."""
    metrics_token_pods: list[str] = Field(default_factory=list)
    """`host:port` patterns (`*` wildcards, e.g. `vllm-*.inference.svc:8000`) of the pods that get
    `metrics_bearer_token`; deployments marked `model_info: {lora_affinity_pod: true}` get it too."""
    embedded_scraper: bool = False
    """Run the scraper inside the proxy (instead of `lora-affinity scrape`)."""
    scraper_lease_ms: int = Field(1_000, ge=50, le=60_000)
    """Only the holder of this Redis lease scrapes; another worker takes over within two lease periods."""

    # Freshness: older metrics make a pod a backup only; past metrics_ttl_ms they are not used at all
    # (and expire from Redis).
    stale_after_ms: int = Field(2_000, ge=10)
    """Older metrics make a pod a backup, used only when no pod is fresh."""
    metrics_ttl_ms: int = Field(10_000, ge=50)
    """Records expire; older than this, metrics are not used at all (LiteLLM's shuffle decides)."""
    dispatch_lag_ms: int = Field(50, ge=0, le=10_000)
    """A request sent this long before a scrape may not have reached the server yet: keep counting it."""
    engine_time_scale: float = Field(1.0, ge=0.01, le=1_000.0)
    """Engine seconds per second of the gateway's clock: 1 for real model servers. A simulated fleet that runs
    faster than real time (`lora-affinity sim --speed`) sets its speed, so that the prompts the gateway counts
    as still computing on a pod end when the engine would end them."""

    # The endpoint picker's v0.2 thresholds (same names and defaults).
    queueing_threshold_lora: int = Field(128, ge=0)
    """The low-queue filter: pods with fewer waiting requests than this."""
    lora_affinity_threshold: float = Field(0.999, ge=0.0, le=1.0)
    """gie-v0.2: the probability of preferring pods running the adapter."""
    kv_cache_threshold: float = Field(0.8, ge=0.0, le=1.0)
    """Sheddable requests: only pods whose KV-cache use is at most this."""
    queue_threshold_critical: int = Field(5, ge=0)
    """Sheddable requests: only pods with at most this many waiting requests (else 429)."""

    # Which rule set runs, and our additions to it.
    enabled: bool = True
    """Off: every request (of the model group, when set per group) goes to LiteLLM's own routing strategy, with
    its weights, rpm/tpm limits and cooldowns, as without the plugin; the proxies follow a live change within one
    refresh. The way to back the plugin out without a restart."""
    shadow: bool = False
    """On: LiteLLM's own strategy routes every request (of the model group, when set per group) and the plugin only
    decides beside it, counting where it would have agreed (`lora_affinity_shadow_total`) and how much sooner its
    pick was predicted to start (`lora_affinity_shadow_predicted_gain_seconds`): a team compares on its own
    traffic before switching."""
    response_headers: bool = False
    """On: each response the plugin routed names where it went and why, in `x-lora-affinity-pod` and
    `x-lora-affinity-reason` (the decision's branch: `predicted_ttft` under the default, `prefix` or `affinity`
    under `lora-affinity-tree`; `explain` and docs/routing.md say what each means). Off by default: a client then
    learns nothing of the fleet."""
    rule_set: str = "lora-affinity"
    """The rule set (a profile of parts, `lora-affinity profiles` lists them): ours, the least predicted time to
    first token (`predicted-ttft` is another name for it); `lora-affinity-tree` (the previous one, a tree of rules),
    `lora-affinity-v1` (the one before), `gie-v0.2` (the endpoint picker's, unchanged), the peers' `llmd-prefix`,
    `llmd-weights`, `llmd-precise`, `llmd-affinity`, `dynamo`, `aibrix-prefix` and `sglang-cache-aware`, kept as
    references, or one of `profiles`."""
    profiles: dict[str, list[str | dict[str, float]]] = Field(default_factory=dict)
    """Your own rule sets: each a list of steps, a step being a part's name, a rule set's name (its steps) or a
    `{scorer: weight}` map, e.g. `{mine: [low_queue, {least_load: 1, prefix_score: 2}, pick]}`."""
    rule_modules: list[str] = Field(default_factory=list)
    """Python modules to import before `profiles` are read: the parts they define become usable by name."""
    spill_queue_margin: int = Field(16, ge=0)
    """`lora-affinity-tree` rules: spill an adapter to another pod once all its pods carry this many more
    requests than the least-loaded pod (a bigger batch is almost free; another adapter is not)."""

    cost_band_ms: int = Field(20, ge=0, le=60_000)
    """The pods whose predicted time to first token (or, in `lora-affinity-tree`, estimated cost) in seconds is
    within this of the least are equal (`explain` shows each term); the rule set's later steps choose among them."""
    cost_band_ratio: float = Field(0.25, ge=0.0, le=10.0)
    """...or within this share of the least (estimates from measured rates carry noise of about this much)."""

    band_width: float = Field(1.0, ge=0.0, le=100.0)
    """Width of the "least" bands in units of (max - min) / N: 1 is the endpoint picker's, 0 keeps only the minimum."""
    disabled_rules: list[str] = Field(default_factory=list)
    """Filters to skip (each passes its input on); the order of the others is the rule set's. `dealt` is a
    choice, not a filter: disabled, gateways stop dealing adapters over the pods and place them by the other rules."""
    model_group_overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per model group (a deployment's `model_name`), any of the settings marked *live, per group*, e.g.
    `{batch-lora: {rule_set: gie-v0.2}}`."""

    count_dispatches: bool = True
    """Add requests sent since a pod's last scrape to its queue (stops herding on one snapshot)."""
    share_inflight: bool = True
    """Share each process's unfinished requests through Redis, so several proxies do not herd."""
    inflight_timeout_ms: int = Field(600_000, ge=1_000)
    """A request no ending hook released after this long is released by the sweeper (a leak)."""
    remember_residency: bool = True
    """Keep adapters an idle pod ran recently as resident (activity metrics forget them)."""
    residency_memory: int = Field(2, ge=1, le=64)
    """How many adapters per GPU slot a pod is remembered to hold (vLLM also keeps CPU copies)."""

    shedding: bool = True
    """Off: sheddable requests are served like critical ones (never 429)."""
    sheddable_model_groups: list[str] = Field(default_factory=list)
    """Model groups whose every request is sheddable."""
    list_served_models: bool = True
    """The proxy's /v1/models adds what the pods' /v1/models list (read by the scraper every models_refresh_ms)."""
    models_refresh_ms: int = Field(30_000, ge=1_000, le=3_600_000)
    """How often the scraper reads the pods' `/v1/models`."""
    default_engine: Literal["vllm", "sglang", "trtllm"] = "vllm"
    """The model server of pods whose deployments name none (`model_info: {engine: sglang}`)."""
    pooled_clients: bool = True
    """Hand text completions to the pods the plugin routes a client over one pool (LiteLLM opens a connection per call)."""
    adapter_info_key: str = "lora_adapter"
    """`model_info` key naming a deployment's adapter explicitly."""

    # Routing for KV reuse (prefix_index.py): what each pod's cache should already hold.
    prefix_affinity: bool = True
    """Send a request to the pod that holds the longest prefix of its prompt, unless that pod is far busier."""
    prefix_queue_margin: int = Field(8, ge=0, le=10_000)
    """A pod holding the prompt's prefix stays eligible while its load (waiting plus running requests) is at most
    this many above the least loaded pod's, or its reported queue at most one longer than the shortest; an
    adapter's holder that holds the prefix stays eligible this far beyond `spill_queue_margin`."""
    prefix_queue_ratio: float = Field(3.0, ge=1.0, le=100.0)
    """...or while its load is at most this many times the least loaded pod's (under load every pod is busy)."""
    prefix_min_blocks: int = Field(2, ge=1, le=4096)
    """Matches shorter than this many blocks do not count (every chat shares its first few characters)."""
    prefix_block_chars: int = Field(256, ge=16, le=65_536)
    """Prompt text is hashed in blocks of this many bytes of UTF-8 (characters, for ASCII)."""
    prefix_max_chars: int = Field(65_536, ge=0, le=16 * 1024 * 1024)
    """At most this much of a prompt is read and hashed: bounds the plugin's time per decision."""
    prefix_chars_per_token: float = Field(4.0, gt=0.0, le=64.0)
    """Characters a token of the served models' tokenizer (about 4 for English text, fewer for code and other
    languages; the simulator's is 3): sizes each pod's index from its cache (num_gpu_blocks x block_size tokens) and
    turns a prompt's characters into tokens for the estimates (prefill, KV room, whether a prompt is a document).
    With `learn_chars_per_token`, the value until a pod's own is learned."""
    learn_chars_per_token: bool = True
    """Learn each pod's characters a token from the prompt token counts its engine reports (`usage.prompt_tokens`
    of a response, or of a stream's last chunk when the client asks for it with `stream_options.include_usage`),
    for prompts of 4 blocks or more; each proxy learns on its own (`fleet/prompt_tokens.py`)."""
    prefix_ttl_ms: int = Field(600_000, ge=1_000)
    """Index entries unused this long are dropped."""
    share_prefixes: bool = True
    """Each proxy's new index entries reach its peers in the refresh it already makes."""
    prefix_isolation: Literal["shared", "team", "key"] = "shared"
    """Whose cached prompts a request may follow: `shared` (or `off`), anyone's (the best reuse; a caller can
    tell by its latency where another caller's prompt is cached); `team`, its LiteLLM team's only (a key in no
    team: its own); `key`, its API key's only. A request's `cache_salt` always separates it too."""

    _built_profiles: dict[str, Any] = PrivateAttr(default_factory=dict)

    # Exact cache state from the engines' KV events (kv_subscriber.py; the `kv-events` extra).
    kv_events: bool = False
    """Follow each pod's KV-cache events (vLLM's `--kv-events-config`) in the scraper, so the prefix index holds
    what the engines report, not what was sent where; pods without events keep the inferred index."""
    kv_events_endpoint: str = "tcp://{host}:5557"
    """Each pod's event publisher; `{host}` is the pod's host (a deployment's
    `model_info.kv_events_endpoint` overrides it)."""
    kv_events_replay_endpoint: str | None = "tcp://{host}:5558"
    """Each pod's replay socket, which refills a gap in its sequence (`model_info.kv_events_replay_endpoint`)."""
    kv_events_topic: str = ""
    """The topic the pods publish under (vLLM's `topic`)."""
    kv_events_data_parallel_size: int = Field(1, ge=1, le=MAX_DATA_PARALLEL_RANKS)
    """Each pod's data-parallel ranks (vLLM's `--data-parallel-size`): rank r publishes on the endpoints' port + r
    (ipc and inproc: the name + `_dp<r>`), and a pod holds what any of its ranks holds
    (`model_info.kv_events_data_parallel_size` overrides it)."""
    tokenizers: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per model group (`*` wildcards), the files a gateway needs to name a prompt's blocks as its engine does:
    `{tokenizer: PATH/tokenizer.json, chat_template: PATH}` (the chat template the engine applies, Jinja; absent:
    chats are not matched exactly). Loaded once, offline."""

    @field_validator("prefix_isolation", mode="before")
    @classmethod
    def _isolation_off(cls, value: Any) -> Any:
        return "shared" if value is False or value == "off" else value  # YAML reads a bare `off` as false

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(SCHEMES):
            raise ValueError(f"must start with one of {', '.join(SCHEMES)}")
        try:
            parse_redis_url(value)
        except ValueError as exc:
            raise ValueError(f"{exc} (in {redact_url(value)})") from None
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> "Settings":
        if self.stale_after_ms > self.metrics_ttl_ms:
            raise ValueError(f"stale_after_ms ({self.stale_after_ms}) must not exceed metrics_ttl_ms "
                             f"({self.metrics_ttl_ms}): a pod cannot turn stale after its record expired")
        for group, override in self.model_group_overrides.items():
            if not isinstance(override, dict):
                raise ValueError(f"model_group_overrides.{group}: expected a mapping of setting names to values")
            bad = sorted(set(override) - set(GROUP_SETTINGS))
            if bad:
                raise ValueError(f"model_group_overrides.{group}.{bad[0]}: not settable per model group; "
                                 f"allowed: {', '.join(GROUP_SETTINGS)}")
            try:
                Settings.model_validate({**self.model_dump(exclude={"model_group_overrides"}), **override})
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(f"model_group_overrides.{group}.{where}: {first['msg'].removeprefix('Value error, ')}"
                                 ) from None
        self._check_rules()
        return self

    def _check_rules(self) -> None:
        from ..routing.profiles import (
            BUILT_IN,
            ProfileError,
            build_profiles,
            import_rule_modules,
            rule_names,
        )

        try:
            import_rule_modules(self.rule_modules)
            built = build_profiles(self.profiles)
        except ProfileError as exc:
            raise ValueError(str(exc)) from None
        if self.rule_set not in BUILT_IN and self.rule_set not in built:
            raise ValueError(f"rule_set: {self.rule_set!r} is not a rule set; choose from: "
                             f"{', '.join([*BUILT_IN, *built])}")
        unknown = sorted(set(self.disabled_rules) - rule_names())
        if unknown:
            raise ValueError(f"disabled_rules: {unknown[0]!r} is not a rule; rules: {', '.join(sorted(rule_names()))}")
        self._built_profiles = built

    def built_profiles(self) -> dict[str, Any]:
        """`profiles` as parts (built once, when these settings were validated)."""
        return self._built_profiles

    def for_group(self, model_group: str) -> "Settings":
        """These settings with the group's overrides applied (validated when the settings were)."""
        override = self.model_group_overrides.get(model_group)
        if not override:
            return self
        return Settings.model_validate({**self.model_dump(exclude={"model_group_overrides"}), **override})

    def redacted_redis_url(self) -> str:
        """The Redis URL with any password replaced, for logs and status output."""
        return redact_url(self.redis_url)


# Settings an operator may change at run time (`lora-affinity thresholds set`); the rest need a restart.
RESTART_ONLY = frozenset({"redis_url", "key_prefix", "embedded_scraper", "metrics_path", "max_page_bytes",
                          "adapter_info_key", "metrics_bearer_token", "metrics_token_pods", "rule_modules",
                          "kv_events", "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic",
                          "kv_events_data_parallel_size", "tokenizers"})
LIVE_SETTINGS = tuple(name for name in Settings.model_fields if name not in RESTART_ONLY)


def redact_url(url: str) -> str:
    """`url` with its passwords (user info and `sentinel_password=`) replaced by ***."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    masked = ""
    if "@" in rest:  # up to the last @ is user info: a password may hold ?, / or # (over-masking beats a leak)
        creds, _, rest = rest.rpartition("@")
        user = creds.split(":", 1)[0] if ":" in creds else ""
        masked = f"{user + ':' if user else ''}***@"
    rest, qsep, query = rest.partition("?")
    if query:
        query = "&".join(f"{k}=***" if "password" in k.lower() else f"{k}{eq}{v}"
                         for k, eq, v in (part.partition("=") for part in query.split("&")))
    return f"{scheme}://{masked}{rest}{qsep}{query}"


def env_reference(value: Any) -> str | None:
    """The variable a value names in LiteLLM's `os.environ/NAME` form (None for any other value)."""
    if isinstance(value, str) and value.startswith("os.environ/"):
        return value.removeprefix("os.environ/")
    return None


def _resolve_env_refs(value: Any, environ: dict[str, str]) -> Any:
    """LiteLLM's `os.environ/NAME` form, so one config file serves both; an unset variable is an error."""
    name = env_reference(value)
    if name is not None:
        if name not in environ:
            raise SettingsError(f"environment variable {name} is not set (referenced as {value!r})")
        return environ[name]
    return value


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """`LORA_AFFINITY_<NAME>` values; pydantic coerces the strings, lists are comma-separated."""
    out: dict[str, Any] = {}
    for name, field in Settings.model_fields.items():
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            origin = getattr(field.annotation, "__origin__", None)
            if origin is list:
                out[name] = [part.strip() for part in raw.split(",") if part.strip()]
            elif origin is dict:  # a mapping (profiles, model_group_overrides) is written as YAML
                out[name] = yaml.safe_load(raw)
            else:
                out[name] = raw
    return out


def build_settings(section: dict[str, Any] | None, environ: dict[str, str] | None = None) -> Settings:
    """Validate a `lora_affinity:` mapping plus environment overrides into Settings."""
    env = dict(os.environ if environ is None else environ)
    raw = {key: _resolve_env_refs(value, env) for key, value in (section or {}).items() if not _retired(key)}
    raw.update(_env_overrides(env))
    try:
        return Settings.model_validate(raw)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc, raw)) from None


RETIRED = {"upstream_keepalive_ms": "pooled connections use LiteLLM's transport: set AIOHTTP_KEEPALIVE_TIMEOUT "
                                   "(seconds, below the model servers' 5 s) in the proxy's environment"}
"""Settings that once existed: ignored with a warning, so an old config still starts."""


def _retired(name: str) -> bool:
    if name in RETIRED:
        logging.getLogger("lora_affinity").warning("lora_affinity.%s is no longer used: %s", name, RETIRED[name])
        return True
    return False


def describe_validation_error(exc: ValidationError, raw: dict[str, Any]) -> str:
    """One line per bad field: its name, the value given and what is allowed (never a secret value)."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        if not err["loc"]:  # a cross-field rule: its message names the fields
            lines.append(err["msg"].removeprefix("Value error, "))
            continue
        given = raw.get(str(err["loc"][0])) if err["loc"] else None
        if field == "redis_url" and isinstance(given, str):
            given = redact_url(given)
        elif field == "metrics_bearer_token":
            given = "***"
        if err["type"] == "extra_forbidden":
            lines.append(unknown_setting(field, Settings.model_fields))
        else:
            lines.append(f"{field}: {given!r} is not allowed: {err['msg']}")
    return "invalid lora_affinity settings: " + "; ".join(lines)


def unknown_setting(name: str, allowed: Iterable[str]) -> str:
    """The error for a name that is no setting: the closest names when some are close, else where to find them."""
    close = difflib.get_close_matches(name, list(allowed), n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
            else "`lora-affinity thresholds show` and docs/configuration.md list the settings")
    return f"{name}: unknown setting; {hint}"


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a LiteLLM proxy config file."""
    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping at the top level")
    return data


def settings_from_config(config: dict[str, Any], environ: dict[str, str] | None = None) -> Settings:
    section = config.get("lora_affinity") or {}
    if not isinstance(section, dict):
        raise SettingsError("lora_affinity: expected a mapping of setting names to values")
    return build_settings(section, environ)
