"""Operational metrics: a small registry the broker owns, and where Prometheus scrapes it.

Rules:
- No globals. The broker creates one `Metrics` and passes it where figures are made;
  tests create their own. Nothing here is registered at import time.
- Only figures, never content: label values are action names, statuses, error codes and
  relay/token operation names. No pubkey, requestId, credential, argument or secret is
  ever a label (that is also what keeps the number of series bounded).
- Bounded cardinality: an action the contract does not know (an agent can send any
  string) is counted as "other", and every family holds at most `MAX_SERIES` label sets;
  later new sets fold into one all-"other" set rather than growing memory.
- Not thread-safe by design: every update happens on the trio event-loop thread (the
  token worker's latency is measured around the `to_thread` hop, on the loop thread).
- `render()` is the registry plus two read-at-scrape sets, in Prometheus text exposition
  format 0.0.4: `process_*` (the names of Prometheus's own process collector, read from
  /proc/self) and ``buzz_broker_build_info{version,python} 1``. Nothing else is read.

Theory of operation: a family is a name, help text, type and a dict from label tuple to
a value (counter/gauge: a float; histogram: per-bucket counts, sum, count). Rendering
walks the families in the fixed order they are declared in `Metrics.__init__`, and each
family's series in sorted label order, so output is deterministic.

Where it is scraped: `scrape_routes` is the route table (``GET``/``HEAD /metrics``) that
`daemon.http.serve` serves, under `SCRAPE_LIMITS`, on a Unix socket (`[metrics] socket`,
mode 0600: only the service user and root read it) and/or a loopback TCP address
(`[metrics] listen`, because Prometheus cannot scrape a 0600 Unix socket; config refuses
any non-loopback address, and a port any local user could bind first unless the operator
accepts that risk: daemon/loopback_tcp.py's squatting rule). Both are off unless configured; daemon/cli/serve.py starts
them. There is no HTTP server in this module: the transport's bounds, fault containment
and stale-socket check are daemon/http.py's. ANY local user can read the TCP port: what
it shows is exactly `render()` (counts by action/status/code, latencies, relay/token
timings, ledger size, open connections, process figures, the version) - never a pubkey,
credential, argument, agent content or key.

WARNING - kept in sync by hand: the metric names and labels below are listed in
docs/install.md ("Metrics"); dashboards depend on them.
"""

from __future__ import annotations

import math
import os
import platform
import resource
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata

from daemon.http import HttpAnswer, HttpLimits, HttpRequest, Routes

__all__ = [
    "Metrics",
    "scrape_routes",
    "SCRAPE_LIMITS",
    "METRICS_PATH",
    "process_lines",
    "REQUEST_BUCKETS",
    "RELAY_BUCKETS",
    "TOKEN_BUCKETS",
    "CONTENT_TYPE",
    "MAX_SERIES",
]

#: Request latency buckets, seconds. The floor is a refusal or a replay (h11 parse 23 µs
#: plus one token hop ≈150 µs, measured in design.md); the middle is a relay round trip
#: (a LAN relay answers in ~1 ms; nostr-sdk's LocalRelay stalls 40 ms on delayed ACK);
#: the top is the relay timeouts (seconds). Fixed: changing them breaks rate() history.
REQUEST_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
#: Relay round trips (EVENT→OK, REQ→EOSE, AUTH→OK): network-bound, 1 ms to the timeouts.
RELAY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Token calls (one worker hop: unseal + sign + wipe). SoftHSM: ≈150 µs hop + 26 µs unseal
#: + 41 µs sign (design.md); a network HSM answers in milliseconds; seconds = trouble.
TOKEN_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.0)

#: The exposition format we speak (Prometheus text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Where Prometheus looks by default.
METRICS_PATH = b"/metrics"
#: Label sets per family before new ones fold into "other" (9 actions × 3 statuses ×
#: ~20 codes is far below this; it only stops a bug or an attacker from growing memory).
MAX_SERIES = 512
OTHER = "other"
#: Statuses a request can end in; "none" = answered without an envelope (HTTP 400/413/…).
STATUSES = frozenset({"succeeded", "failed", "indeterminate", "none"})

_PREFIX = "buzz_broker_"

Labels = tuple[str, ...]


@dataclass
class _Histogram:
    """Per-bucket (non-cumulative) counts; cumulated only when rendered."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:  # Prometheus buckets are "less than or equal" (le)
                self.counts[i] += 1
                break
        self.total += value
        self.count += 1


@dataclass
class _Family:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    label_names: tuple[str, ...]
    buckets: tuple[float, ...] = ()
    values: dict[Labels, float] = field(default_factory=dict)
    histograms: dict[Labels, _Histogram] = field(default_factory=dict)

    def _key(self, labels: Labels) -> Labels:
        if len(labels) != len(self.label_names):
            raise ValueError(f"{self.name}: expected labels {self.label_names}, got {len(labels)} values")
        series = self.histograms if self.kind == "histogram" else self.values
        if labels in series or len(series) < MAX_SERIES:
            return labels
        return tuple(OTHER for _ in labels)

    def add(self, labels: Labels, amount: float) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def set(self, labels: Labels, value: float) -> None:
        self.values[self._key(labels)] = value

    def observe(self, labels: Labels, value: float) -> None:
        key = self._key(labels)
        hist = self.histograms.get(key)
        if hist is None:
            hist = self.histograms[key] = _Histogram(self.buckets)
        hist.observe(value)


def escape_label_value(value: str) -> str:
    """Text format 0.0.4: backslash, double quote and line feed are escaped in label values."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    # HELP lines escape backslash and line feed only (quotes are literal there).
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value as Prometheus reads it: integers without a fraction, +Inf/-Inf/NaN."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _labels_text(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{escape_label_value(v)}"' for n, v in zip(names, values))
    return "{" + inner + "}"


def _render_family(fam: _Family, out: list[str]) -> None:
    out.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
    out.append(f"# TYPE {fam.name} {fam.kind}")
    if fam.kind != "histogram":
        for labels in sorted(fam.values):
            out.append(f"{fam.name}{_labels_text(fam.label_names, labels)} {format_value(fam.values[labels])}")
        return
    names = (*fam.label_names, "le")
    for labels in sorted(fam.histograms):
        hist = fam.histograms[labels]
        cumulative = 0
        for bound, n in zip(hist.bounds, hist.counts):
            cumulative += n
            out.append(f"{fam.name}_bucket{_labels_text(names, (*labels, format_value(bound)))} {cumulative}")
        # +Inf holds every observation, including those above the last bound.
        out.append(f"{fam.name}_bucket{_labels_text(names, (*labels, '+Inf'))} {hist.count}")
        out.append(f"{fam.name}_sum{_labels_text(fam.label_names, labels)} {format_value(hist.total)}")
        out.append(f"{fam.name}_count{_labels_text(fam.label_names, labels)} {hist.count}")


class Metrics:
    """The broker's figures. One instance per broker; see the module docstring for rules.

    Args:
        actions: the action names the contract knows (`buzzwire.contract.ACTIONS`); any
            other action string an agent sends is counted as "other".
    """

    def __init__(self, *, actions: Iterable[str]) -> None:
        self._actions = frozenset(actions)
        self._requests = _Family(
            _PREFIX + "requests_total", "counter",
            "Requests answered, by action, status and error code (code is empty on success).",
            ("action", "status", "code"),
        )
        self._latency = _Family(
            _PREFIX + "request_duration_seconds", "histogram",
            "Time from a request's last byte to its answer, by action.",
            ("action",), REQUEST_BUCKETS,
        )
        self._relay_total = _Family(
            _PREFIX + "relay_round_trips_total", "counter",
            "Relay round trips (publish, query, auth), by operation and result.",
            ("op", "result"),
        )
        self._relay_latency = _Family(
            _PREFIX + "relay_round_trip_seconds", "histogram",
            "Relay round-trip time, by operation.",
            ("op",), RELAY_BUCKETS,
        )
        self._token = _Family(
            _PREFIX + "token_call_seconds", "histogram",
            "PKCS#11 token calls (one worker hop each), by operation.",
            ("op",), TOKEN_BUCKETS,
        )
        self._ledger = _Family(
            # Counted by the sweeper (daemon/wiring.py), not at scrape: the ledger keeps a
            # running count of bytes, not of records, and a count is a query on its writer.
            _PREFIX + "ledger_size", "gauge",
            "Records in the idempotency ledger, counted at start and after each hourly sweep.",
            (),
        )
        self._connections = _Family(
            _PREFIX + "open_connections", "gauge", "Agent connections open now.", ()
        )
        self._ledger.set((), 0)
        self._connections.set((), 0)
        self._families = (
            self._requests, self._latency, self._relay_total, self._relay_latency,
            self._token, self._ledger, self._connections,
        )

    def request(self, action: str | None, status: str | None, code: str | None, seconds: float) -> None:
        """Count one answered request and observe its latency.

        Args:
            action: the wire action name, or None when the request was not correlated.
            status: the envelope status wire string, or None for an answer without one.
            code: the error code wire string, or None on success.
            seconds: time from the request's last byte to the answer.
        """
        act = action if action in self._actions else ("" if action is None else OTHER)
        st = status if status in STATUSES else ("none" if status is None else OTHER)
        self._requests.add((act, st, code or ""), 1)
        self._latency.observe((act,), max(0.0, seconds))

    def relay_round_trip(self, op: str, result: str, seconds: float) -> None:
        """One relay round trip: op = publish|query|auth; result = accepted|rejected|timeout|…"""
        self._relay_total.add((op, result), 1)
        self._relay_latency.observe((op,), max(0.0, seconds))

    def token_call(self, op: str, seconds: float) -> None:
        """One token worker hop (op = sign|sign_auth|mint|memory_address|…)."""
        self._token.observe((op,), max(0.0, seconds))

    def set_ledger_size(self, records: int) -> None:
        self._ledger.set((), records)

    def set_open_connections(self, count: int) -> None:
        self._connections.set((), count)

    def connection_opened(self) -> None:
        self._connections.add((), 1)

    def connection_closed(self) -> None:
        self._connections.add((), -1)

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format 0.0.4 (UTF-8, ends in a newline)."""
        out: list[str] = []
        for fam in self._families:
            _render_family(fam, out)
        out.extend(process_lines())
        return ("\n".join(out) + "\n").encode("utf-8")


def _version() -> str:
    try:
        return metadata.version("buzz-broker")
    except metadata.PackageNotFoundError:
        return "unknown"  # run from a checkout that was never installed


#: Read once: the package's version cannot change under a running process.
_BUILD = (_version(), platform.python_version())
#: Clock ticks per second, for /proc/self/stat's utime/stime.
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _boot_time() -> float:
    # Not /proc/stat's btime: the unit's ProcSubset=pid hides it. The boot clock is the
    # kernel's uptime, which the start time in /proc/self/stat counts from.
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def _gauge(name: str, kind: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {format_value(value)}"]


def process_lines() -> list[str]:
    """``buzz_broker_build_info`` and the standard ``process_*`` families, read now.

    A figure /proc cannot give (not Linux, a hardened /proc) is left out, not invented.
    """
    version, python = _BUILD
    out = [
        "# HELP buzz_broker_build_info The running version (value is always 1).",
        "# TYPE buzz_broker_build_info gauge",
        f'buzz_broker_build_info{{version="{escape_label_value(version)}",'
        f'python="{escape_label_value(python)}"}} 1',
    ]
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            # Fields after the ")" that closes comm (comm may hold spaces and parentheses).
            fields = handle.read().rsplit(")", 1)[1].split()
        utime, stime = int(fields[11]), int(fields[12])
        start_ticks, vsize, rss_pages = int(fields[19]), int(fields[20]), int(fields[21])
    except (OSError, ValueError, IndexError):
        return out
    out += _gauge("process_cpu_seconds_total", "counter",
                  "Total user and system CPU time spent in seconds.", (utime + stime) / _TICKS)
    out += _gauge("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
                  rss_pages * resource.getpagesize())
    out += _gauge("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.",
                  vsize)
    out += _gauge("process_start_time_seconds", "gauge",
                  "Start time of the process since unix epoch in seconds.",
                  _boot_time() + start_ticks / _TICKS)
    try:
        open_fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        return out
    out += _gauge("process_open_fds", "gauge", "Number of open file descriptors.", open_fds)
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        out += _gauge("process_max_fds", "gauge", "Maximum number of open file descriptors.",
                      soft)
    return out


# --- where it is scraped --------------------------------------------------------------

#: The bounds of the metrics listeners (the admin socket and the TCP listener), smaller
#: than the agents' socket's because a scrape is one short GET from one scraper:
#: - 8 connections at once, further clients waiting in the listen backlog as on the
#:   agents' socket; 2 of them per peer uid (the kernel's, over TCP too), past which a
#:   connection is 503 at once: any local user can reach the TCP port, and one that held
#:   every slot would starve the scraper;
#: - one request per connection (``Connection: close``): an idle scraper holds no slot;
#: - 8 KiB of request head; no body (any body is 413, nothing is held: the byte budget
#:   is the 1-byte minimum `daemon.http.HttpLimits` allows);
#: - 5 s to send the request and to read the answer.
#: The metrics servers are cancelled (hard stop) once the agents' socket has drained, so
#: the grace period is never used.
SCRAPE_LIMITS = HttpLimits(
    max_connections=8,
    max_connections_per_uid=2,
    max_inflight_bytes=1,
    max_body_bytes=0,
    max_header_bytes=8 * 1024,
    request_timeout=5.0,
    shutdown_grace=0.0,
    keep_alive=False,
)


def scrape_routes(registry: Metrics) -> Routes:
    """``GET``/``HEAD /metrics`` (any query string ignored) answered with `registry.render()`.

    Another method on /metrics is 405 (``Allow: GET, HEAD``); any other path is 404.
    """

    async def scrape(request: HttpRequest) -> HttpAnswer:
        return HttpAnswer(200, registry.render(), CONTENT_TYPE)

    return Routes({(b"GET", METRICS_PATH): scrape, (b"HEAD", METRICS_PATH): scrape},
                  ignore_query=True)
