"""Run-time settings in Redis: one versioned copy every proxy replica and the scraper follow.

Layout (same `{prefix}` hash tag as the pod records):
    {prefix}:settings        JSON {"version", "values", "updated_at", "by"}: the live copy
    {prefix}:settings:audit  a stream of changes (when, who, old and new values), capped
    {prefix}:settings:notify pub/sub channel: the new version, so followers need not wait for their poll

Writers use compare-and-set on the version (WATCH/MULTI), so of two racing operators one wins and
the other is told. Followers poll the key with the pod records they read anyway (no extra round
trip) and also listen on the channel; a value that fails validation is refused and the last good
settings stay in force.

During a rolling upgrade a newer version may write names this one does not know: followers apply the
names they know and leave the others (`foreign`), and a writer carries them along untouched, so old
and new proxies follow the same copy.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

import redis
import yaml

from .settings import (
    LIVE_SETTINGS,
    RESTART_ONLY,
    Settings,
    SettingsError,
    describe_validation_error,
    unknown_setting,
)

AUDIT_MAXLEN = 1000


def settings_key(prefix: str) -> str:
    return f"{{{prefix}}}:settings"


def audit_key(prefix: str) -> str:
    return f"{{{prefix}}}:settings:audit"


def notify_channel(prefix: str) -> str:
    return f"{{{prefix}}}:settings:notify"


class ConflictError(RuntimeError):
    """Someone else changed the settings first."""


@dataclass(frozen=True)
class LiveCopy:
    version: int
    values: dict[str, Any]
    updated_at: float
    by: str
    epoch: str = ""
    """Names one history of versions: a copy seeded afresh (Redis lost its data, or a first start) gets a new
    one, and followers apply its versions from 1 again instead of skipping them as older ("": written before
    epochs existed)."""

    def to_json(self) -> str:
        body = {"version": self.version, "values": self.values, "updated_at": self.updated_at, "by": self.by}
        if self.epoch:
            body["epoch"] = self.epoch
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> LiveCopy:
        """Raises SettingsError naming what is wrong with a hand-written or foreign value."""
        try:
            body = json.loads(raw)
        except (ValueError, TypeError) as exc:
            raise SettingsError(f"live settings are not JSON: {exc}") from None
        if not isinstance(body, dict) or not isinstance(body.get("values"), dict):
            raise SettingsError("live settings: expected an object with a 'values' mapping")
        version = body.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise SettingsError(f"live settings: version {version!r} is not a positive integer")
        epoch = body.get("epoch")
        return cls(version, body["values"], float(body.get("updated_at") or 0), str(body.get("by") or "?"),
                   epoch[:64] if isinstance(epoch, str) else "")


def new_epoch() -> str:
    return uuid.uuid4().hex[:12]


def live_values(settings: Settings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in LIVE_SETTINGS}


def foreign(values: dict[str, Any]) -> dict[str, Any]:
    """The names in a live copy this version does not know (a newer version's settings)."""
    return {name: value for name, value in values.items() if name not in Settings.model_fields}


def apply_live(base: Settings, values: dict[str, Any], *, ignore_foreign: bool = False) -> Settings:
    """`base` (the file and environment) with the live values on top, validated as one model. A follower
    passes `ignore_foreign`: names a newer version wrote are left out, not a reason to refuse the copy."""
    if ignore_foreign:
        values = {name: value for name, value in values.items() if name in Settings.model_fields}
    unknown = sorted(set(values) - set(Settings.model_fields))
    if unknown:
        raise SettingsError(unknown_setting(unknown[0], LIVE_SETTINGS))
    fixed = sorted(set(values) & RESTART_ONLY)
    if fixed:
        raise SettingsError(f"{fixed[0]}: cannot change at run time (restart with a new config); "
                            f"live settings are {', '.join(LIVE_SETTINGS)}")
    merged = {**base.model_dump(), **values}
    try:
        return Settings.model_validate(merged)
    except Exception as exc:  # pydantic's ValidationError
        raise SettingsError(describe_validation_error(exc, merged)) from None


class LiveFollower:
    """Where one process stands in the live settings' history (the proxies' refresh and the scraper both follow
    it): `offer` each copy read from Redis; a newer version, or any version of a new history (Redis lost its data
    and was seeded again), is applied over the file's `base`; one that does not validate is refused, said once,
    and the last good settings stay."""

    def __init__(self, base: Settings, who: str, logger: logging.Logger) -> None:
        self.base, self.who, self._logger = base, who, logger
        self.version = 0
        self.epoch = ""
        self.refused = 0
        """Copies refused so far (each distinct copy once)."""
        self._last_raw: bytes | str | None = None

    @property
    def applied(self) -> str:
        """`epoch:version` of the copy in force ("" before any)."""
        return f"{self.epoch or '-'}:{self.version}" if self.version else ""

    def offer(self, raw: bytes | str) -> Settings | None:
        """The settings to apply now, or None (the copy is not newer, was seen already, or was refused)."""
        if raw == self._last_raw:
            return None  # unchanged since the last look, good or bad: nothing to parse, nothing to log
        self._last_raw = raw
        try:
            copy = LiveCopy.from_json(raw)
            restarted = self.version > 0 and copy.epoch != self.epoch
            if copy.version <= self.version and not restarted:
                return None
            if restarted:
                self._logger.warning("live settings start a new history at version %s (epoch %s, was %s at version "
                                     "%s): applied; did Redis lose its data?", copy.version, copy.epoch or "-",
                                     self.epoch or "-", self.version)
            settings = apply_live(self.base, copy.values, ignore_foreign=True)
        except SettingsError as exc:
            self.refused += 1
            self._logger.error("%s refused live settings, keeping version %s: %s", self.who, self.version, exc)
            return None
        newer = foreign(copy.values)
        if newer:
            self._logger.info("live settings version %s names settings this version does not know (%s): applied "
                              "without them", copy.version, ", ".join(sorted(newer)))
        self.version, self.epoch = copy.version, copy.epoch
        return settings


def parse_assignments(pairs: Iterable[str]) -> dict[str, Any]:
    """`key=value` words from the command line; values are YAML scalars or lists (`a=[x, y]`)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SettingsError(f"{pair!r}: expected key=value")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def read(client: redis.Redis, prefix: str) -> LiveCopy | None:
    raw = client.get(settings_key(prefix))
    return None if raw is None else LiveCopy.from_json(raw)


def seed(client: redis.Redis, base: Settings, by: str, force: bool = False) -> bool:
    """Write the file's values as version 1 when Redis has none (or always, with force)."""
    if force:
        write(client, base, live_values(base), by)
        return True
    copy = LiveCopy(1, live_values(base), time.time(), by, new_epoch())
    return bool(client.set(settings_key(base.key_prefix), copy.to_json(), nx=True))


def write(client: redis.Redis, base: Settings, changes: dict[str, Any], by: str,
          if_version: int | None = None, source: str | None = None) -> tuple[LiveCopy | None, LiveCopy]:
    """Validate and apply `changes` atomically; raises SettingsError (nothing written) or ConflictError.

    `source` (e.g. the file `thresholds apply` read) goes into the audit entry beside the operator."""
    prefix = base.key_prefix
    key = settings_key(prefix)
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(key)
            raw = pipe.get(key)
            old = LiveCopy.from_json(raw) if raw is not None else None
            current = old.version if old else 0
            if if_version is not None and if_version != current:
                raise ConflictError(f"settings are at version {current}, not {if_version}: "
                                    "someone else changed them; look at `thresholds history` and retry")
            before = old.values if old else live_values(base)
            carried = {k: v for k, v in foreign(before).items() if k not in changes}  # a newer version's names
            checked = apply_live(base, {**{k: v for k, v in before.items() if k not in carried}, **changes})
            new = LiveCopy(current + 1, {**carried, **live_values(checked)}, time.time(), by,
                           old.epoch if old and old.epoch else new_epoch())
            changed_from, changed_to = diff(before, new.values)
            if old is not None and not changed_to:  # nothing changes: no new version, no audit entry
                pipe.unwatch()
                return old, old
            pipe.multi()
            pipe.set(key, new.to_json())
            entry = {"version": new.version, "by": by, "at": new.updated_at,
                     "old": json.dumps(changed_from), "new": json.dumps(changed_to)}
            if source:
                entry["source"] = source
            pipe.xadd(audit_key(prefix), entry, maxlen=AUDIT_MAXLEN, approximate=True)
            pipe.execute()
        except redis.WatchError:
            raise ConflictError("another operator changed the settings at the same moment; retry") from None
    client.publish(notify_channel(prefix), str(new.version))  # a nudge; followers poll anyway
    return old, new


def values_at(client: redis.Redis, prefix: str, current: LiveCopy, version: int) -> dict[str, Any]:
    """The values as they were at `version` of the current history: the current ones with each later change
    undone from the audit trail, newest first. SettingsError when the trail does not reach back that far."""
    if not 1 <= version <= current.version:
        raise SettingsError(f"rollback: version {version} is not between 1 and the current {current.version}")
    values = dict(current.values)
    wanted = set(range(version + 1, current.version + 1))
    for entry in history(client, prefix, count=AUDIT_MAXLEN):
        if entry["version"] in wanted:
            values.update(entry["old"])
            wanted.discard(entry["version"])
    if wanted:
        raise SettingsError(f"rollback: the audit trail no longer holds version {max(wanted)} (it keeps the last "
                            f"{AUDIT_MAXLEN} changes); nothing changed")
    return values


def diff(old: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    keys = [k for k in new if old.get(k) != new.get(k)]
    return {k: old.get(k) for k in keys}, {k: new[k] for k in keys}


def history(client: redis.Redis, prefix: str, count: int = 20) -> list[dict[str, Any]]:
    out = []
    for entry_id, fields in client.xrevrange(audit_key(prefix), count=count):
        decoded = {k.decode(): v.decode() for k, v in fields.items()}
        out.append({"id": entry_id.decode(), "version": int(decoded["version"]), "by": decoded["by"],
                    "at": float(decoded["at"]), "old": json.loads(decoded["old"]), "new": json.loads(decoded["new"]),
                    "source": decoded.get("source")})
    return out


def read_file(path: str) -> dict[str, Any]:
    """A settings file for `thresholds apply`: the `lora_affinity:` section of a config.yaml, or that
    section's body alone. Only live settings may appear (restart-only ones are named in the error)."""
    try:
        with open(path, encoding="utf-8") as handle:
            body = yaml.safe_load(handle)
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: not YAML ({exc})") from None
    if isinstance(body, dict) and "lora_affinity" in body:
        body = body["lora_affinity"]
    if not isinstance(body, dict) or not body:
        raise SettingsError(f"{path}: expected a mapping of setting names to values (or a `lora_affinity:` section)")
    return body


def drift(live: dict[str, Any], wanted: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The names whose live value is not the file's, with (live, file) values."""
    return {name: (live.get(name), value) for name, value in wanted.items() if live.get(name) != value}
