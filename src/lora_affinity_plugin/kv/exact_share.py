"""The exact index, shared: the scraper's changes to it reach every proxy through Redis, off the request path.

The scraper that follows the pods' KV events appends each interval's changes (per pod: cleared or not, keys
added, keys removed) to a capped stream, numbered; every few seconds it writes a snapshot of every pod's keys
with the number it covers. A proxy loads the snapshot once, then applies the stream's entries in its refresh;
a number it did not expect (it fell behind the cap, or the scraper restarted) makes it load the snapshot again.
A proxy only ever holds key sets (`HeldBlocks`): no msgpack or ZeroMQ on its side.
"""

from __future__ import annotations

import logging
import struct
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .token_blocks import leading

FORMAT = b"K1"
logger = logging.getLogger("lora_affinity")

_POD = struct.Struct("<HBHII")
"""Per pod: name length, flags, block size, keys added, keys removed."""
_UNFIT: set[str] = set()
"""Pods already warned of as not fitting the format."""
_CLEARED, _PARTIAL_GIVEN, _PARTIAL = 1, 2, 4
"""Flags. A reader that knows only `_CLEARED` (an older release) ignores the others: the format stays K1."""
CHANGE_SETS_PER_REFRESH = 1_000
"""A proxy's refresh reads at most this many change sets; a backlog is read over the next refreshes."""


SNAPSHOT_PART_BYTES = 1 << 20
"""A snapshot past this size is written in parts of whole pods, about this size each, one command per part (one
write of tens of megabytes would hold Redis up for every client)."""
SNAPSHOT_PART_TTL_MS = 120_000
"""How long a part outlives its snapshot: a reader that read the snapshot's header reads its parts well within."""


RANK_MARK = "#dp"
"""A data-parallel rank's index is kept under its pod's key plus this and the rank (rank 0 under the pod's own): each
rank is an engine of its own, with its own cache and event stream, behind the pod's one API server."""


def rank_key(pod: str, rank: int) -> str:
    return pod if rank == 0 else f"{pod}{RANK_MARK}{rank}"


def rank_pod(key: str) -> str:
    """The pod a rank's key belongs to (a pod's own key: itself)."""
    return key.split(RANK_MARK, 1)[0]


def changes_key(prefix: str) -> str:
    return f"{{{prefix}}}:kv:changes"


def snapshot_key(prefix: str) -> str:
    return f"{{{prefix}}}:kv:snapshot"


def snapshot_part_key(prefix: str, generation: str, part: int) -> str:
    return f"{{{prefix}}}:kv:snapshot:{generation}:{part}"


def snapshot_parts(snapshot: Mapping[str, PodChange], part_bytes: int | None = None) -> list[bytes]:
    """The snapshot as change sets of whole pods, each at most about `part_bytes` (`SNAPSHOT_PART_BYTES`; a larger
    pod alone)."""
    part_bytes = part_bytes or SNAPSHOT_PART_BYTES
    parts, current, size = [], {}, 0
    for pod, change in snapshot.items():
        pod_bytes = _POD.size + len(pod) + 8 * (len(change.added) + len(change.removed))
        if current and size + pod_bytes > part_bytes:
            parts.append(encode_changes(current))
            current, size = {}, 0
        current[pod] = change
        size += pod_bytes
    parts.append(encode_changes(current))
    return parts


def snapshot_header(epoch: str, number: int, last_id: str, parts: Sequence[bytes]) -> tuple[dict, list[bytes]]:
    """The snapshot hash's fields and the parts to write under `snapshot_part_key` first: one part goes in the
    hash itself (`c`, as every release reads it); more are named by generation `g` (`epoch:number`) and count
    `k`, and a release that reads only `c` finds none (it stays on the inferred index: never a wrong figure)."""
    header = {"e": epoch, "n": number, "i": last_id}
    if len(parts) == 1:
        return {**header, "c": parts[0]}, []
    return {**header, "g": f"{epoch}:{number}", "k": len(parts)}, list(parts)


def snapshot_part_keys(prefix: str, fields: Mapping[bytes, bytes]) -> list[str]:
    """The part keys a snapshot hash names (none: it holds its one part itself, or names none of this epoch)."""
    generation = _generation(fields)
    return [] if generation is None else [snapshot_part_key(prefix, generation, j) for j in range(int(fields[b"k"]))]


def read_snapshot(fields: Mapping[bytes, bytes], parts: Sequence[bytes | None] = ()
                  ) -> tuple[dict[str, PodChange], int, bytes, str]:
    """(every pod's keys, the change-set number it covers, its epoch, the stream id it continues from) from the
    snapshot hash and the parts it names (`snapshot_part_keys`, in order). KeyError or ValueError: unreadable."""
    if _generation(fields) is None:
        changes = decode_changes(fields[b"c"])
    else:
        changes = {}
        for part in parts:
            if part is None:
                raise ValueError("a snapshot part has expired")
            changes.update(decode_changes(part))
    return changes, int(fields[b"n"]), fields[b"e"], fields[b"i"].decode()


def _generation(fields: Mapping[bytes, bytes]) -> str | None:
    """The parts' generation, when it is this header's (a writer of an earlier release replaces `c`, `e` and `n`
    but leaves `g`: a generation of another epoch or number is not this snapshot's)."""
    generation = fields.get(b"g")
    if generation is None or generation != fields.get(b"e", b"") + b":" + fields.get(b"n", b""):
        return None
    return generation.decode()


@dataclass(slots=True)
class PodChange:
    cleared: bool = False
    """Forget the pod's keys before adding these (a restart, or a whole snapshot)."""
    block_size: int = 0
    added: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)
    partial: bool | None = None
    """The pod's index may lack blocks its engine holds (its stream joined late, a gap lost past the replay
    buffer), until the pod clears its cache; None: unchanged."""


def _flags(change: PodChange) -> int:
    flags = _CLEARED if change.cleared else 0
    if change.partial is not None:
        flags |= _PARTIAL_GIVEN | (_PARTIAL if change.partial else 0)
    return flags


def encode_changes(changes: Mapping[str, PodChange]) -> bytes:
    """The change set in format K1. A pod whose figures do not fit the format's fields (a block size past 65,535,
    a name past 65,535 bytes) is left out, with a warning once: it costs that pod's exact figures, never the
    fleet's change set."""
    out = [FORMAT]
    for pod, change in changes.items():
        name = pod.encode("utf-8", "surrogatepass")
        if not 0 <= change.block_size <= 0xFFFF or len(name) > 0xFFFF:
            if pod not in _UNFIT:
                _UNFIT.add(pod)
                logger.warning("KV events of %s: block size %s (or its name) does not fit the shared format; its "
                               "exact figures are not shared", pod[:200], change.block_size)
            continue
        out.append(_POD.pack(len(name), _flags(change), change.block_size, len(change.added),
                             len(change.removed)))
        out.append(name)
        out.append(array("Q", sorted(change.added)).tobytes())
        out.append(array("Q", sorted(change.removed)).tobytes())
    return b"".join(out)


def decode_changes(data: bytes) -> dict[str, PodChange]:
    """ValueError on anything but this format (a newer writer's entry is skipped by the caller, never half-read)."""
    if not data.startswith(FORMAT):
        raise ValueError("not a K1 change set")
    view, at, out = memoryview(data), len(FORMAT), {}
    while at < len(data):
        try:
            name_len, flags, block_size, n_added, n_removed = _POD.unpack_from(view, at)
        except struct.error:
            raise ValueError("truncated change set") from None
        at += _POD.size
        pod = bytes(view[at:at + name_len]).decode("utf-8", "surrogatepass")
        at += name_len
        added = array("Q")
        added.frombytes(view[at:at + 8 * n_added])
        at += 8 * n_added
        removed = array("Q")
        removed.frombytes(view[at:at + 8 * n_removed])
        at += 8 * n_removed
        if len(added) != n_added or len(removed) != n_removed:
            raise ValueError("truncated change set")
        partial = bool(flags & _PARTIAL) if flags & _PARTIAL_GIVEN else None
        out[pod] = PodChange(bool(flags & _CLEARED), block_size, set(added), set(removed), partial)
    return out


class HeldBlocks:
    """A proxy's copy of the exact index: per pod, the keys of the blocks its engine holds."""

    def __init__(self) -> None:
        self._keys: dict[str, set[int]] = {}
        self._block_size: dict[str, int] = {}
        self._partial: set[str] = set()
        self._ranks: dict[str, list[str]] = {}
        """Per pod, its data-parallel ranks' keys past rank 0 (`rank_key`): a pod holds what any of its ranks holds."""
        self.number: int | None = None
        """The last change set applied (-1: none yet after the snapshot; None: no snapshot loaded)."""

    def apply(self, changes: Mapping[str, PodChange]) -> None:
        for pod, change in changes.items():
            keys = self._keys.get(pod)
            if keys is None and RANK_MARK in pod:
                self._ranks.setdefault(rank_pod(pod), []).append(pod)
            if keys is None or change.cleared:
                keys = self._keys[pod] = set()
                self._partial.discard(pod)
            if change.partial:
                self._partial.add(pod)
            elif change.partial is not None:
                self._partial.discard(pod)
            keys -= change.removed
            keys |= change.added
            if change.block_size:
                self._block_size[pod] = change.block_size

    def load(self, snapshot: Mapping[str, PodChange], number: int) -> None:
        self._keys.clear()
        self._block_size.clear()
        self._partial.clear()
        self._ranks.clear()
        self.apply(snapshot)
        self.number = number

    def _own(self, pod: str) -> list[str]:
        """The pod's keys: its own and its ranks' past 0."""
        ranks = self._ranks.get(pod)
        return [pod, *ranks] if ranks else [pod]

    def has(self, pod: str) -> bool:
        return pod in self._keys or pod in self._ranks

    def block_size(self, pod: str) -> int | None:
        return next((size for key in self._own(pod) if (size := self._block_size.get(key))), None)

    def partial(self, pod: str) -> bool:
        """Whether the pod's keys may be missing some its engines hold (then they are a floor, not the truth)."""
        return any(key in self._partial for key in self._own(pod))

    def size(self, pod: str) -> int:
        return sum(len(self._keys.get(key, ())) for key in self._own(pod))

    def match(self, pod: str, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt's chain `pod` holds: on its best rank (vLLM's server hands a request
        to one rank by load, so this is the most the pod can offer)."""
        ranks = self._ranks.get(pod)
        if not ranks:  # (the request path's common case: one engine behind the pod)
            return leading(self._keys.get(pod), keys)
        return max(leading(self._keys.get(key), keys) for key in (pod, *ranks))


def apply_entries(held: HeldBlocks, epoch: bytes, entries: Iterable[tuple[Any, Mapping[bytes, bytes]]]) -> str | None:
    """The stream's change sets, in order, onto `held` (a proxy's refresh, `explain`): returns the id of the last
    one applied (None: none). A number out of turn, another epoch (a new scraper) or an unreadable entry leaves
    `held.number` None: load the snapshot again."""
    last = None
    for entry_id, fields in entries:
        if held.number is None:
            break
        try:
            number = int(fields[b"n"])
        except (KeyError, TypeError, ValueError):  # unreadable: which change set it is cannot be known
            held.number = None
            break
        if fields.get(b"e") != epoch or number != held.number + 1:
            if fields.get(b"e") == epoch and number <= held.number:
                continue  # (written before the snapshot this copy loaded)
            held.number = None
            break
        try:
            held.apply(decode_changes(fields[b"c"]))
        except (KeyError, ValueError):
            held.number = None
            break
        held.number = number
        last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return last
