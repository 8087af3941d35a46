"""Operator commands: `thresholds show|set|apply|history|reset|rollback`, `status`, `explain`.

All of them find Redis through `--config` (the proxy's config.yaml, whose `lora_affinity:` section and
LORA_AFFINITY_* environment give the base settings) or `--redis-url`.
"""

from __future__ import annotations

import argparse
import functools
import getpass
import json
import os
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import redis

from ..config import live_settings
from ..config.connection import sync_client
from ..config.settings import Settings, SettingsError, load_config, settings_from_config
from ..fleet.clock import redis_seconds
from ..fleet.inflight import prefix_stream_key, read_applied, read_shared_tables
from ..fleet.lease import lease_key
from ..fleet.pods import discover_pods
from ..fleet.request_builder import RequestBuilder
from ..fleet.store import PodRecord, decode_records, pod_key
from ..fleet.view import FleetView
from ..kv.exact_share import (
    apply_entries,
    changes_key,
    read_snapshot,
    snapshot_key,
    snapshot_part_keys,
)
from ..kv.prefix_index import decode_entries
from ..routing.placement import tokens_per_block
from ..routing.profiles import BUILT_IN, STEP_KINDS, describe, part_names
from ..routing.scheduling import SchedulingError, choose_pod
from ..routing.ttft import predictions


def show_defaults(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Every subcommand's help shows each option's default."""
    subparsers.add_parser = functools.partial(subparsers.add_parser,  # type: ignore[method-assign]
                                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return subparsers


def add_ops_arguments(sub) -> None:
    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", help="the proxy's config.yaml")
        p.add_argument("--redis-url", help="overrides lora_affinity.redis_url")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    th = sub.add_parser("thresholds", help="show and change the live routing settings")
    th_sub = show_defaults(th.add_subparsers(dest="action", required=True))
    common(th_sub.add_parser("show", help="the settings in force and their version"))
    setp = common(th_sub.add_parser("set", help="change settings: key=value ..."))
    setp.add_argument("assignments", nargs="+", metavar="key=value")
    setp.add_argument("--if-version", type=int, help="refuse unless the settings are at this version")
    setp.add_argument("--by", help="who makes the change (default: $LORA_AFFINITY_OPERATOR or the login)")
    apply = common(th_sub.add_parser("apply", help="make the live settings what a YAML file says (settings as code)"))
    apply.add_argument("file", help="YAML: a config.yaml's lora_affinity: section, or its body alone")
    apply.add_argument("--check", action="store_true",
                       help="change nothing; exit 1 when the live settings differ from the file (drift check)")
    apply.add_argument("--if-version", type=int, help="refuse unless the settings are at this version")
    apply.add_argument("--by", help="who applies it (default: $LORA_AFFINITY_OPERATOR or the login)")
    hist = common(th_sub.add_parser("history", help="the audit trail of changes"))
    hist.add_argument("--count", type=int, default=20)
    reset = common(th_sub.add_parser("reset", help="back to the config file's values (a new version)"))
    reset.add_argument("--by")
    rollback = common(th_sub.add_parser("rollback", help="back to the values of an earlier version (a new version)"))
    rollback.add_argument("version", type=int, help="the version to return to (`thresholds history` lists them)")
    rollback.add_argument("--by")
    th.set_defaults(func=run_thresholds)

    status = common(sub.add_parser("status", help="what the router sees: pods, metrics age, settings version"))
    status.add_argument("--watch", type=float, nargs="?", const=1.0, help="refresh every N seconds")
    status.set_defaults(func=run_status)

    explain = common(sub.add_parser("explain", help="dry-run one routing decision on the live snapshot"))
    explain.add_argument("--model", required=True, help="the requested model (adapter) name")
    explain.add_argument("--criticality", choices=["critical", "sheddable"], default="critical")
    explain.add_argument("--seed", type=int, default=0)
    explain.add_argument("--prompt", help="a completion prompt: show each pod's matched prefix for it")
    explain.add_argument("--messages", metavar="FILE", help="a JSON file of chat messages (instead of --prompt)")
    explain.add_argument("--cache-salt", help="the request's cache_salt")
    explain.add_argument("--chars-per-token", type=float, metavar="R",
                         help="count the prompt at R characters a token, as a proxy that learned R does (its "
                              "lora_affinity_pod_chars_per_token); default: the settings' prefix_chars_per_token")
    explain.set_defaults(func=run_explain)

    rules = sub.add_parser("rules", help="the rule sets (built-in and the config's profiles) and their parts")
    rules.add_argument("--config", help="the proxy's config.yaml (its profiles and rule_modules)")
    rules.add_argument("--json", action="store_true", help="machine-readable output")
    rules.add_argument("name", nargs="?", help="one rule set, step by step")
    rules.set_defaults(func=run_rules)


def _context(args: argparse.Namespace) -> tuple[Settings, dict, redis.Redis]:
    config = load_config(args.config) if args.config else {}
    environ = dict(os.environ)
    if args.redis_url:
        environ["LORA_AFFINITY_REDIS_URL"] = args.redis_url
    settings = settings_from_config(config, environ)
    client = sync_client(settings.redis_url)
    return settings, config, client


def _operator(args: argparse.Namespace) -> str:
    if getattr(args, "by", None):
        return args.by
    try:
        return os.environ.get("LORA_AFFINITY_OPERATOR") or getpass.getuser()
    except Exception:
        return "unknown"


def _print(args: argparse.Namespace, data, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else text)


def run_thresholds(args: argparse.Namespace) -> int:
    base, _, client = _context(args)
    prefix = base.key_prefix
    try:
        if args.action == "show":
            copy = live_settings.read(client, prefix)
            values = copy.values if copy else live_settings.live_values(base)
            data = {**values, "version": copy.version if copy else 0}
            lines = [f"version {data['version']}" + ("" if copy else " (not seeded yet: the config's values)")]
            try:  # a copy written by hand may hold what proxies refuse: say so, not print it as in force
                live_settings.apply_live(base, values, ignore_foreign=True)
            except SettingsError as exc:
                data["refused"] = str(exc)
                lines[0] += f" REFUSED by every proxy and scraper ({exc}); they keep the last good version"
            lines += [f"  {k} = {v}" for k, v in values.items()]
            lines += _applied_lines(client, prefix, copy, data)
            _print(args, data, "\n".join(lines))
        elif args.action in ("set", "reset", "rollback"):
            if args.action == "set":
                changes = live_settings.parse_assignments(args.assignments)
                live_settings.apply_live(base, changes)  # names and types first, for a clear message
            elif args.action == "rollback":
                current = live_settings.read(client, prefix)
                if current is None:
                    raise SettingsError("rollback: no live settings in Redis yet")
                changes = {k: v for k, v in live_settings.values_at(client, prefix, current, args.version).items()
                           if k in Settings.model_fields}  # (a newer release's names are carried as they are)
                args.if_version = current.version  # the trail read is this version's: refuse if it moved
            else:
                changes, args.if_version = live_settings.live_values(base), None
            source = f"rollback to version {args.version}" if args.action == "rollback" else None
            old, new = live_settings.write(client, base, changes, _operator(args), args.if_version, source=source)
            diff_old, diff_new = live_settings.diff(old.values if old else live_settings.live_values(base),
                                                    new.values)
            _print(args, {"version": new.version, "old": diff_old, "new": diff_new},
                   f"version {new.version}: " + (", ".join(f"{k} {diff_old.get(k)!r} -> {v!r}"
                                                            for k, v in diff_new.items()) or "no change"))
        elif args.action == "apply":
            return _apply(args, base, client)
        elif args.action == "history":
            entries = live_settings.history(client, prefix, args.count)
            lines = [f"v{e['version']:<4} {_when(e['at'])}  {e['by']:<16} "
                     + ", ".join(f"{k}: {e['old'].get(k)!r} -> {v!r}" for k, v in e["new"].items())
                     + (f"  (from {e['source']})" if e.get("source") else "")
                     for e in entries]
            _print(args, entries, "\n".join(lines) or "no changes recorded")
    except SettingsError as exc:
        print(f"error: {exc}; nothing changed", file=sys.stderr)
        return 2
    except live_settings.ConflictError as exc:
        print(f"error: {exc}; nothing changed", file=sys.stderr)
        return 3
    except redis.RedisError as exc:
        print(f"error: Redis at {base.redacted_redis_url()}: {type(exc).__name__}", file=sys.stderr)
        return 4
    return 0


def _applied_lines(client: redis.Redis, prefix: str, copy: live_settings.LiveCopy | None, data: dict) -> list[str]:
    """What each proxy refreshing now applies, beside what Redis holds; a warning for each that differs (a copy it
    refused, a proxy of another history after Redis lost its data, one that has not refreshed since)."""
    applied = read_applied(client, prefix)
    data["proxies"] = applied
    if not applied:
        return ["proxies: none refreshing (none started, or all of an earlier release)"]
    held = f"{copy.epoch or '-'}:{copy.version}" if copy else None
    agree = sorted(process for process, value in applied.items() if value == held)
    lines = [f"proxies: {len(agree)} of {len(applied)} apply version {copy.version if copy else 0}"]
    for process, value in sorted(applied.items()):
        if value != held:
            epoch, _, version = value.rpartition(":")
            data.setdefault("disagree", {})[process] = value
            lines.append(f"  WARNING {process} applies version {version} (epoch {epoch})")
    return lines


def _apply(args: argparse.Namespace, base: Settings, client: redis.Redis) -> int:
    """Validate the file, show how the live settings differ from it, then (unless --check) apply the
    difference as one version. Nothing to change writes nothing, so applying a file twice is a no-op."""
    wanted = live_settings.read_file(args.file)
    live_settings.apply_live(base, wanted)  # names, types and bounds first: a clear error, nothing written
    copy = live_settings.read(client, base.key_prefix)
    live = copy.values if copy else live_settings.live_values(base)
    version = copy.version if copy else 0
    differs = live_settings.drift(live, wanted)
    lines = [f"{name}: {old!r} -> {new!r}" for name, (old, new) in differs.items()]
    if args.check:
        _print(args, {"version": version, "in_sync": not differs, "drift": {k: {"live": o, "file": n}
                                                                         for k, (o, n) in differs.items()}},
               f"version {version}: " + ("in sync with " + args.file if not differs
                                         else f"differs from {args.file}:\n  " + "\n  ".join(lines)))
        return 1 if differs else 0
    if not differs:
        _print(args, {"version": version, "old": {}, "new": {}}, f"version {version}: no change ({args.file} is applied)")
        return 0
    _, new = live_settings.write(client, base, {k: n for k, (_, n) in differs.items()}, _operator(args),
                                 args.if_version, source=os.path.abspath(args.file))
    _print(args, {"version": new.version, "old": {k: o for k, (o, _) in differs.items()},
                  "new": {k: n for k, (_, n) in differs.items()}},
           f"version {new.version}, from {args.file}:\n  " + "\n  ".join(lines))
    return 0


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def redis_now(client: redis.Redis, settings: Settings) -> float:
    """Redis's clock, which records are stamped on (`fleet/clock.py`): ages read the same from any host. Read from
    the node that holds the plugin's keys (a Cluster's nodes each have their own clock)."""
    return redis_seconds(client.eval("return redis.call('TIME')", 1, lease_key(settings.key_prefix)))


def _records(client: redis.Redis, settings: Settings, pods: list[str]) -> dict[str, PodRecord]:
    if not pods:
        pattern = pod_key(settings, "*")
        pods = sorted(k.decode().split(":pod:", 1)[1] for k in client.scan_iter(match=pattern, count=1000))
    records = decode_records(pods, client.mget([pod_key(settings, p) for p in pods])) if pods else {}
    return {p: records.get(p) for p in pods}


def status_rows(settings: Settings, records: dict[str, PodRecord | None], now: float,
                leader: str | None = "?") -> list[dict]:
    """Each pod's row; `leader` None (no scraper holds the lease): a pod without a record is `unknown`, not down,
    since nothing has looked at it."""
    rows = []
    for pod, record in records.items():
        if record is None:
            rows.append({"pod": pod, "state": "unknown", "error": "no record: no scraper holds the lease"}
                        if leader is None else
                        {"pod": pod, "state": "down", "error": "no record (never scraped, or expired)"})
            continue
        age = record.age_s(now)
        m = record.metrics
        state = "down" if m is None else "stale" if age * 1000 > settings.stale_after_ms else "fresh"
        row = {"pod": pod, "state": state, "age_s": round(age, 3), "error": record.error, "scraper": record.scraper,
               "proven": record.proven, "degraded": list(record.degraded)}
        if m is not None:
            row.update({"waiting": m.num_requests_waiting, "running": m.num_requests_running,
                        "kv_pct": round(m.kv_cache_usage * 100, 1), "running_adapters": sorted(m.running_lora_adapters),
                        "waiting_adapters": sorted(m.waiting_lora_adapters), "max_lora": m.max_lora,
                        "engine": m.engine})
        rows.append(row)
    return rows


def _status_text(rows: list[dict], version: int, settings: Settings, leader: str | None, proxies: int) -> str:
    lines = [f"settings version {version}; Redis {settings.redacted_redis_url()}; scraper leader: {leader or 'none'}; "
             f"proxies sharing in-flight counts: {proxies}",
             f"{'pod':<28}{'engine':<8}{'state':<7}{'age s':>7}{'wait':>6}{'run':>5}{'sent':>5}{'prefix':>7}{'KV %':>6}"
             f"{'max':>5}  running / waiting adapters"]
    for r in rows:
        if "waiting" in r:
            lines.append(f"{r['pod']:<28}{r['engine']:<8}{r['state']:<7}{r['age_s']:>7.2f}{r['waiting']:>6}{r['running']:>5}"
                         f"{r['inflight']:>5}{r.get('prefix_blocks', 0):>7}"
                         f"{r['kv_pct']:>6}{str(r['max_lora']):>5}  {','.join(r['running_adapters']) or '-'} / "
                         f"{','.join(r['waiting_adapters']) or '-'}")
            if r.get("degraded"):
                lines.append(f"{'':<28}read in part, routed on the rest: {'; '.join(r['degraded'])}")
        else:
            unproven = "" if r.get("proven", True) else " (never read as a model server: LiteLLM routes it)"
            lines.append(f"{r['pod']:<28}{'-':<8}{r['state']:<7}{r.get('age_s', '-'):>7}  {r['error']}{unproven}")
    return "\n".join(lines)


UNHEALTHY = 3
"""`status`'s exit code when no scraper holds the lease or no pod's record is fresh (4: Redis unreachable)."""


def run_status(args: argparse.Namespace) -> int:
    settings, config, client = _context(args)
    pods = discover_pods(config.get("model_list") or [])
    while True:
        try:
            copy = live_settings.read(client, settings.key_prefix)
            holder = client.get(lease_key(settings.key_prefix))
            leader = holder.decode() if holder else None
            rows = status_rows(settings, _records(client, settings, pods), redis_now(client, settings), leader)
            proxies, inflight, index_sizes = read_shared_tables(client, settings.key_prefix)
        except redis.RedisError as exc:
            print(f"error: Redis at {settings.redacted_redis_url()}: {type(exc).__name__}", file=sys.stderr)
            return 4
        for row in rows:
            row["inflight"] = inflight.get(row["pod"], 0)
            row["prefix_blocks"] = index_sizes.get(row["pod"], 0)
        version = copy.version if copy else 0
        text = _status_text(rows, version, settings, leader, proxies)
        if args.watch:
            print("\033[2J\033[H" + text, flush=True)
            time.sleep(args.watch)
            continue
        _print(args, {"settings_version": version, "leader": leader, "proxies_sharing": proxies, "pods": rows}, text)
        return 0 if leader and any(row["state"] == "fresh" for row in rows) else UNHEALTHY


def run_explain(args: argparse.Namespace) -> int:
    base, config, client = _context(args)
    copy = live_settings.read(client, base.key_prefix)
    settings = live_settings.apply_live(base, copy.values, ignore_foreign=True) if copy else base
    pods = discover_pods(config.get("model_list") or [])
    records = {p: r for p, r in _records(client, settings, pods).items() if r is not None}
    fleet = FleetView(settings)
    now = redis_now(client, settings)  # records are on Redis's clock (clock.py): so is this view
    fleet.update(records, now)
    candidates = fleet.candidates(list(records), now)
    messages = _explained_messages(args)
    _replay_shared_prefixes(client, fleet, settings)
    if settings.kv_events:
        _load_exact_index(client, fleet, settings)
    request = RequestBuilder().build(fleet, args.model, args.model, messages, {"cache_salt": args.cache_salt},
                                     [c.key for c in candidates], settings, args.criticality == "sheddable")
    if args.chars_per_token is not None:
        if not 0 < args.chars_per_token <= 64:
            print("error: --chars-per-token: a number above 0 and at most 64", file=sys.stderr)
            return 2
        request.chars_per_token = args.chars_per_token
    chars_per_token = request.chars_per_token or settings.prefix_chars_per_token
    ratio_source = "given" if args.chars_per_token is not None else "the settings'"
    data: dict = {"model": args.model, "criticality": args.criticality, "settings_version": copy.version if copy else 0,
                  "rule_set": settings.rule_set, "candidates": [c.key for c in candidates],
                  "view": {c.key: {"waiting": c.waiting, "running": c.running, "kv": round(c.kv_cache_usage, 3)}
                           for c in candidates},
                  "prefix_blocks": request.prefix_blocks, "chars_per_token": chars_per_token,
                  "prefix_matches": {c.key: request.prefix_matches.get(c.key, 0) for c in candidates},
                  "match_sources": {c.key: request.match_sources.get(c.key, "inferred") for c in candidates}}
    try:
        decision = choose_pod(candidates, request, settings, random.Random(args.seed), explain=True)
    except SchedulingError as exc:
        data.update({"pick": None, "status": exc.status_code, "error": str(exc)})
        _print(args, data, f"no pick: HTTP {exc.status_code}: {exc}")
        return 0
    steps, before = [], list(data["candidates"])
    for name, out, values in decision.trace:
        steps.append({"rule": name, "in": before, "out": list(out), **({"values": values} if values else {})})
        before = list(out)
    data.update({"pick": decision.pod, "branch": decision.branch, "rules": steps,
                 "costs": {pod: {"total_s": round(c.total_s, 4), "wait_s": round(c.wait_s, 4),
                                 "adapter_load_s": round(c.adapter_s, 4), "prefill_s": round(c.prefill_s, 4),
                                 "uncached_tokens": c.uncached_tokens, "harm_s": round(c.harm_s, 4),
                                 "adds_adapter": c.adds_adapter, "duplicated_tokens": c.duplicated_tokens}
                           for pod, c in decision.costs.items()},
                 "rates": {c.key: c.rates.to_dict() for c in candidates},
                 "slowness": {c.key: c.slowness for c in candidates}})
    view = {c.key: c for c in candidates}
    lines = [f"{args.model} ({args.criticality}), rule set {settings.rule_set}, settings v{data['settings_version']}",
             f"  prompt prefix: {request.prefix_blocks} blocks of {settings.prefix_block_chars} characters"
             + (f", about {round(request.prefix_blocks * tokens_per_block(request, settings))} tokens at "
                f"{chars_per_token:g} characters a token ({ratio_source}; "
                f"each proxy learns its pods' own: --chars-per-token)" if request.prefix_blocks
                else " (none: short prompt, or no --prompt/--messages)"),
             "  candidates (waiting, running, KV, active adapters, matched prefix blocks and where that came from):"]
    lines += [f"    {c.key}: {c.waiting}, {c.running}, {c.kv_cache_usage:.2f}, {','.join(sorted(c.active_adapters)) or '-'}, "
              f"{request.prefix_matches.get(c.key, 0)}/{request.prefix_blocks} "
              f"({request.match_sources.get(c.key, 'inferred')})"
              for c in view.values()]
    if decision.costs:
        lines.append("  estimated cost (rates learned from each pod's histograms, or defaults):")
        lines += [f"    {pod}: {parts.describe()}" + ("" if view[pod].rates.learned else " (default rates)")
                  + (f" (slowness {view[pod].slowness:.2f} against the fleet)" if view[pod].slowness != 1.0 else "")
                  for pod, parts in decision.costs.items()]
    predicted = predictions(candidates, request, settings)
    data["predictions"] = {pod: {"total_s": round(t.total_s, 4), "ttft_s": round(t.ttft_s, 4),
                                 "adapter_s": round(t.adapter_s, 4), "queue_s": round(t.queue_s, 4),
                                 "room_s": round(t.room_s, 4), "prefill_s": round(t.prefill_s, 4),
                                 "generation_s": round(t.generation_s, 4), "harm_s": round(t.harm_s, 4),
                                 "uncached_tokens": t.uncached_tokens}
                           for pod, t in predicted.items()}
    lines.append("  predicted time to first token (the default rule set's terms):")
    lines += [f"    {pod}: {t.describe()}" for pod, t in predicted.items()]
    for s in steps:
        lines.append(f"  {s['rule']:<18} {len(s['in'])} -> {len(s['out'])}: {', '.join(s['out'])}")
        if s.get("values"):  # a scorer: each candidate's value, lower is better
            lines.append("  " + " " * 18 + " " + ", ".join(f"{pod} {value:g}" for pod, value in s["values"].items()))
    lines.append(f"  pick: {decision.pod} (branch {decision.branch})")
    _print(args, data, "\n".join(lines))
    return 0


def run_rules(args: argparse.Namespace) -> int:
    """The rule sets the settings know, each as its steps; or the parts a profile may list."""
    config = load_config(args.config) if args.config else {}
    settings = settings_from_config(config)
    sets = {**BUILT_IN, **settings.built_profiles()}
    if args.name:
        if args.name not in sets:
            print(f"no rule set {args.name!r}; choose from: {', '.join(sets)}", file=sys.stderr)
            return 2
        lines = describe(sets[args.name])
        _print(args, {"rule_set": args.name, "steps": lines}, f"{args.name}:\n" + "\n".join("  " + ln for ln in lines))
        return 0
    parts = {kind: part_names(kind) for kind in STEP_KINDS}
    text = [f"rule sets: {', '.join(sets)} (in force: {settings.rule_set})",
            "parts a profile may list (lora_affinity.profiles):"]
    text += [f"  {kind}s: {', '.join(names)}" for kind, names in parts.items()]
    _print(args, {"rule_sets": list(sets), "rule_set": settings.rule_set, "parts": parts}, "\n".join(text))
    return 0


def _explained_messages(args: argparse.Namespace) -> list | None:
    if args.messages:
        return json.loads(Path(args.messages).read_text())
    if args.prompt:
        return [{"role": "user", "content": args.prompt}]  # how LiteLLM hands a completion's prompt to routing
    return None


def _load_exact_index(client: redis.Redis, fleet: FleetView, settings: Settings) -> None:
    """What the engines report their caches hold, as the proxies read it (the snapshot and the changes since)."""
    prefix = settings.key_prefix
    snap = client.hgetall(snapshot_key(prefix))
    if not snap:
        return
    keys = snapshot_part_keys(prefix, snap)
    changes, number, epoch, last_id = read_snapshot(snap, client.mget(keys) if keys else [])
    fleet.held.load(changes, number)
    apply_entries(fleet.held, epoch, client.xrange(changes_key(prefix), min=last_id))


def _replay_shared_prefixes(client: redis.Redis, fleet: FleetView, settings: Settings) -> None:
    """The proxies' recent index entries, as shared through Redis: what a proxy would match against."""
    for _, fields in client.xrange(prefix_stream_key(settings.key_prefix), "-", "+"):
        for pod, at, hashes in decode_entries(fields.get(b"e", b"")):
            fleet.prefixes.add_shared(pod, hashes, at)
