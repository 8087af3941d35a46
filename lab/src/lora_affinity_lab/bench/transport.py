"""What a live run does to TCP and to the proxies: connections each pod accepted, the proxies' open sockets,
their CPU per request and per worker, and LiteLLM's "Unclosed client session" warnings (an aiohttp session
left to the garbage collector).

A proxy worker is one Python process on one core: above about 85% of that core over the measured window
its queue, not the routing, decides the latencies, so such a row measures the proxy (`saturated`).

The simulator counts accepted connections and the peak of requests in flight per replica; a pooled
client opens at most as many connections as it has requests in flight at once.
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

UNCLOSED = "Unclosed client session"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
SATURATED = 0.85
"""A proxy worker busier than this share of a core over the measured window measures the proxy, not the routing."""
SIM_LAGGED = 0.10
"""Simulated replicas that lost more than this share of the window to late steps measured this machine."""
MACHINE_SATURATED = 0.90
"""A machine whose cores were busier than this share of the window ran every process late: the proxies, the
load generator and the simulated fleet queued for CPU, and a faster-than-real-time fleet waited on them."""


def replica_counters(url: str) -> tuple[int, int, int, float]:
    """(connections accepted, closed idle by the server, peak requests in flight, seconds lost to late steps)
    from a simulated replica."""
    page = httpx.get(url + "/metrics", timeout=5).text

    def value(name: str) -> float:
        found = re.search(rf"^{name} (\S+)", page, re.M)
        return float(found.group(1)) if found else 0.0

    return (int(value("sim_connections_accepted_total")), int(value("sim_connections_idle_closed_total")),
            int(value("sim_requests_in_flight_peak")), value("sim_lag_seconds_total"))


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all this machine's cores since boot (/proc/stat; idle and I/O wait are not busy)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - fields[3] - fields[4], total


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (the proxy serves in its main process with --num_workers 1)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants: a proxy run with `--num_workers N` serves in N child processes."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def tree_cpu(pids: list[int]) -> dict[int, float]:
    """CPU seconds per process of the proxies' trees (a process gone since is left out)."""
    out = {}
    for root in pids:
        for pid in process_tree(root):
            try:
                out[pid] = cpu_seconds(pid)
            except (OSError, IndexError, ValueError):
                pass
    return out


def open_sockets(pid: int) -> int:
    count = 0
    for fd in os.scandir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(fd.path).startswith("socket:")
        except OSError:
            pass
    return count


@dataclass
class TransportStats:
    requests: int = 0
    connections: list[int] = field(default_factory=list)
    """Per replica: TCP connections accepted during the load."""
    idle_closed: list[int] = field(default_factory=list)
    """Per replica: connections the server closed for idleness during the load (each one may be reopened)."""
    peak_in_flight: list[int] = field(default_factory=list)
    """Per replica: most requests in flight at once."""
    proxy_sockets: dict[str, int] = field(default_factory=dict)
    """The proxies' open sockets sampled over the run: median and max (summed over proxies)."""
    unclosed_sessions: int = 0
    proxy_cpu_ms_per_request: float = 0.0
    """The proxies' CPU (every process, supervisor and workers) over the load, per request."""
    proxy_busiest_worker: float = 0.0
    """The busiest proxy process's CPU over the measured window, as a share of one core."""
    proxy_requests_per_s: float = 0.0
    """Requests the proxies sustained over the measured window (wall clock, all proxies together)."""
    sim_lag_share: float = 0.0
    """The most lagging simulated replica's real seconds lost to late steps, as a share of the window."""
    machine_busy: float = 0.0
    """This machine's cores' busy share over the window (every process, the benchmark's own included)."""

    @property
    def saturated(self) -> bool:
        return self.proxy_busiest_worker > SATURATED

    @property
    def sim_lagged(self) -> bool:
        """The machine could not run the simulated replicas at this speed: the fleet was slower than modelled."""
        return self.sim_lag_share > SIM_LAGGED

    @property
    def machine_saturated(self) -> bool:
        return self.machine_busy > MACHINE_SATURATED

    @property
    def connections_per_1k(self) -> float:
        return 1000 * sum(self.connections) / self.requests if self.requests else 0.0

    @property
    def pooled(self) -> bool:
        """The goal: no pod saw more new connections than its peak of requests in flight.

        `idle_closed` is shown beside it: a pooled client reopens what the server closed when idle (vLLM
        after 5 s), and an unpooled one leaves every connection idle until the server closes it."""
        return all(c <= p for c, p in zip(self.connections, self.peak_in_flight))

    @classmethod
    def from_dict(cls, data: dict) -> TransportStats:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def to_dict(self) -> dict:
        return {**asdict(self), "connections_per_1k": round(self.connections_per_1k, 1), "pooled": self.pooled}


class TransportProbe:
    """Started before the load and stopped after it; samples the proxies' sockets in a thread."""

    def __init__(self, replica_urls: list[str], proxy_pids: list[int], proxy_logs: list[Path]) -> None:
        self.replica_urls, self.proxy_pids, self.proxy_logs = replica_urls, proxy_pids, proxy_logs
        self._before = [replica_counters(u) for u in replica_urls]
        self._cpu_before = tree_cpu(proxy_pids)
        self._machine_before = machine_cpu()
        self._serving = list(self._cpu_before)  # every process of every proxy (workers included)
        self._started = time.monotonic()
        self._unclosed_before = sum(_count(p, UNCLOSED) for p in proxy_logs)
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self._samples.append(sum(map(open_sockets, self._serving)))
            except OSError:  # a proxy exited: the run's errors will say so
                return

    def stop(self, requests: int) -> TransportStats:
        self._stop.set()
        self._thread.join()
        window = time.monotonic() - self._started
        cpu_after = tree_cpu(self.proxy_pids)
        busy, total = (after - before for after, before in zip(machine_cpu(), self._machine_before))
        # A worker that started during the window counts from zero.
        per_process = [cpu_after[pid] - self._cpu_before.get(pid, 0.0) for pid in cpu_after]
        cpu = sum(per_process)
        after = [replica_counters(u) for u in self.replica_urls]
        samples = self._samples or [0]
        return TransportStats(
            requests=requests,
            # minus the connection of the reading that counted `after` itself
            connections=[a[0] - b[0] - 1 for a, b in zip(after, self._before)],
            idle_closed=[a[1] - b[1] for a, b in zip(after, self._before)],
            peak_in_flight=[a[2] for a in after],
            proxy_sockets={"median": int(statistics.median(samples)), "max": max(samples)} if self.proxy_pids else {},
            unclosed_sessions=sum(_count(p, UNCLOSED) for p in self.proxy_logs) - self._unclosed_before,
            proxy_cpu_ms_per_request=round(1000 * cpu / requests, 2) if requests else 0.0,
            proxy_busiest_worker=round(max(per_process, default=0.0) / window, 3) if window > 0 else 0.0,
            proxy_requests_per_s=round(requests / window, 2) if window > 0 and self.proxy_pids else 0.0,
            sim_lag_share=round(max((a[3] - b[3] for a, b in zip(after, self._before)), default=0.0) / window, 3)
            if window > 0 else 0.0,
            machine_busy=round(busy / total, 3) if total > 0 else 0.0,
        )


def _count(path: Path, needle: str) -> int:
    try:
        return path.read_text(errors="replace").count(needle)
    except OSError:
        return 0


def format_transport_table(rows: list[tuple[str, TransportStats]]) -> str:
    head = (f"{'strategy':<26}{'conns/1k req':>13}{'conns per pod':>15}{'peak in flight':>16}{'idle-closed':>13}"
            f"{'pooled':>8}"
            f"{'proxy sockets med/max':>23}{'unclosed':>10}{'CPU ms/req':>12}{'busiest worker':>16}"
            f"{'sim lag':>9}{'machine':>9}")
    lines = [head, "-" * len(head)]
    for name, t in rows:
        sockets = f"{t.proxy_sockets.get('median', 0)}/{t.proxy_sockets.get('max', 0)}" if t.proxy_sockets else "-"
        lines.append(f"{name:<26}{t.connections_per_1k:>13.0f}{_span(t.connections):>15}{_span(t.peak_in_flight):>16}"
                     f"{_span(t.idle_closed):>13}{'yes' if t.pooled else 'no':>8}{sockets:>23}{t.unclosed_sessions:>10}"
                     f"{t.proxy_cpu_ms_per_request:>12.2f}{load_label(t):>16}"
                     f"{t.sim_lag_share:>9.0%}{t.machine_busy:>9.0%}")
    return "\n".join(lines)


def load_label(t: TransportStats) -> str:
    """The busiest proxy worker's share of a core, marked when it measured the proxy."""
    if not t.proxy_requests_per_s:
        return "-"
    return f"{t.proxy_busiest_worker:.0%}" + (" SATURATED" if t.saturated else "")


def _span(values: list[int]) -> str:
    return f"{min(values)}-{max(values)}" if values else "-"
