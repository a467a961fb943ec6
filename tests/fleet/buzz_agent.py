"""A Buzz-shaped agent: what Buzz's `buzz-acp` runtime in broker mode does to a host.

Written here from ../shared/spec/buzz-client.md (facts read from upstream source), not from
this repo's own client (client/buzz_broker_client): the point is to load the host the way
Buzz's runtime does, and to read its answers as strictly as Buzz's reader does, so a host
that answers our own client but not Buzz's shows up. Used by tests/fleet/test_fleet.py (in
`make test`) and benchmarks/fleet.py.

What it does, as the spec says the runtime does:
- **Transport.** A base URL, `http://` on `localhost`, a loopback IPv4 address or `[::1]`
  (no userinfo, query or fragment; `https://` is Buzz's too, but this host serves no TLS, so
  this client refuses it rather than pretend). `POST <base>/v1/action`, `Authorization:
  Bearer`, the frozen request bytes; no redirects followed (an answer is read whatever the
  status). One 30 s end-to-end timeout per call. The answer is capped at 2 MiB, plus
  `PER_MESSAGE_ALLOWANCE` × `limit` for `channel.read`; `Content-Length` is checked against
  the cap before a byte of the body is read. Keep-alive connections, a small pool per agent
  (an HTTP client's pool: one connection per request in flight; an idle one the host has
  closed is dropped, not reused).
  `unix:/path` instead of a URL is an AF_UNIX transport, which Buzz does not have: only so
  the benchmark can drive a host from before the TCP listener (or over its socket) with the
  very same client.
- **Strict reading** (buzz-sdk `validate_for`): JSON with no duplicate member anywhere and
  no NaN; the exact member set per status (`replayed` optional, false when absent); the
  status/code pairing; the requestId and action echoed; each outcome's shape for the action
  asked, a page no longer than its limit. Anything else is **no answer**, not a verdict.
- **Start.** `storage.address {"slug":"core"}` (its own pubkey: the runtime cannot start
  without it), `storage.get {"slug":"core"}`, `presence.set online`.
- **Polls.** Every `interval` seconds one `channel.read` per configured channel, `limit`
  100, `mentionsOnly` as configured per channel, a fresh UUIDv4 `requestId` each time,
  never resent. `nextCursor` is used as a continuation only; without one the next poll
  reads the default window again. Timer-driven: a tick whose previous poll of that channel
  is still in flight is *skipped* (counted as scheduled, not sent), so a slow host lowers
  the client's own load, and the benchmark counts what was scheduled. The timer counts
  from the moment `run()` began (`timer_origin="start"`, the first tick being the first
  one after the start calls are answered), so agents started at random moments poll at
  random phases; `timer_origin="ready"` counts from the start calls' answers instead,
  and agents whose start calls a host answers together then poll together, every tick.
- **De-duplication** by event id, two rotating sets of 2,000 ids, as the runtime keeps;
  events whose signature fails or whose first `h` tag is not the polled channel are dropped.
- **Turns.** A new event that mentions the agent (a `p` tag naming it) starts a turn, as a
  mention wakes Buzz's runtime: `typing.set` on the channel, `observer.emit` with the
  frames a turn reports (`turn_started`, `acp_read`), `liveness.ping` for the turn.
  `unsupported` is a normal answer to each of them. At a clean stop, `presence.set offline`.
- `unauthenticated`, from any call, ends the agent; any other failure is counted and
  polling goes on.

A generator shortcut, not Buzz's behaviour: each event id's hash and signature are verified
once per process (`VERIFIED`), and an event arriving again under an id already verified,
with the same pubkey and signature, is taken as verified without re-hashing. Buzz verifies
every event it keeps; here re-verifying the same 100-event windows 256 times a second would
measure the generator, not the host. Structure is still checked on every event of every
answer.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import json
import math
import re
import select
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import coincurve
import h11
import trio

__all__ = ["Endpoint", "NoAnswer", "Verdict", "Transport", "BuzzAgent", "AgentStats",
           "read_answer", "parse_endpoint", "response_cap", "TIMEOUT_SECONDS",
           "BASE_CAP_BYTES", "PER_MESSAGE_ALLOWANCE", "VERIFIED"]

#: One end-to-end timeout per call (buzz-client.md, Transport).
TIMEOUT_SECONDS = 30.0
#: The answer cap: 2 MiB for every action ...
BASE_CAP_BYTES = 2 * 1024 * 1024
#: ... plus this much per message a read may hold. buzz-client.md states the shape of the
#: rule, not the figure; 128 KiB is our choice: a 64 KiB event whose content is JSON-escaped
#: fits, and a host cannot push a fleet's generator past ~15 MiB per read.
PER_MESSAGE_ALLOWANCE = 128 * 1024
#: The runtime's default page and default poll period (BUZZ_BROKER_POLL_INTERVAL_MS).
POLL_LIMIT = 100
DEFAULT_INTERVAL = 1.0
MIN_INTERVAL = 0.1
#: Where an agent's poll timer counts from: the moment `run()` began, or the moment its
#: start calls were answered (module docstring, "Polls").
TIMER_ORIGINS = ("start", "ready")
#: De-duplication: two rotating sets of this many ids.
DEDUP_SET_SIZE = 2000
_RECEIVE = 65536

FAILED_CODES = frozenset({
    "invalid_request", "unsupported_protocol_version", "unknown_action",
    "unsupported_action_version", "unsupported", "unauthenticated", "unauthorized",
    "request_id_conflict", "action_failed", "internal"})
INDETERMINATE_CODES = frozenset({"outcome_unknown", "internal"})
_CORE = frozenset({"type", "protocolVersion", "requestId", "status"})
MEMBERS = {"succeeded": _CORE | {"action", "outcome"}, "failed": _CORE | {"error"},
           "indeterminate": _CORE | {"error"}}
EVENT_MEMBERS = frozenset({"id", "pubkey", "created_at", "kind", "tags", "content", "sig"})


class NoAnswer(Exception):
    """No valid envelope for this request: a transport failure, whatever the bytes were."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the host is: a TCP (host, port) with its `Host` header, or a Unix socket path."""

    host_header: str
    path_prefix: str
    tcp: tuple[str, int] | None = None
    unix_path: str | None = None


def parse_endpoint(base: str) -> Endpoint:
    """A Buzz base URL (http on loopback only), or `unix:/path` (this client's extension)."""
    if base.startswith("unix:"):
        path = base[len("unix:"):]
        if not path.startswith("/"):
            raise ValueError("unix: needs an absolute socket path")
        return Endpoint("localhost", "", unix_path=path)
    parts = urlsplit(base)
    if parts.scheme != "http":
        raise ValueError("this client speaks http:// on loopback only (the host serves no TLS)")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise ValueError("a base URL has no userinfo, query or fragment")
    host = parts.hostname or ""
    if host != "localhost":
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError("http:// only on localhost, a loopback IPv4 address or [::1]") from None
        if not (address.is_loopback and (address.version == 4 or host == "::1")):
            raise ValueError("http:// only on localhost, a loopback IPv4 address or [::1]")
    port = parts.port or 80
    return Endpoint(parts.netloc, parts.path.rstrip("/"), tcp=(host, port))


def response_cap(action: str, args: Mapping[str, Any]) -> int:
    """The most bytes of answer this request may get."""
    if action != "channel.read":
        return BASE_CAP_BYTES
    limit = args.get("limit", POLL_LIMIT)
    return BASE_CAP_BYTES + PER_MESSAGE_ALLOWANCE * int(limit)


class Transport:
    """Keep-alive HTTP/1.1 to one host with one credential; one request per connection at a
    time, idle connections reused (as an HTTP client's pool does)."""

    def __init__(self, endpoint: Endpoint, credential: str) -> None:
        if not credential or any(c in credential for c in "\r\n\0") or not credential.isascii():
            raise ValueError("the credential must be non-empty and header-safe")
        self.endpoint = endpoint
        self._auth = f"Bearer {credential}"
        self._idle: list[tuple[trio.abc.Stream, h11.Connection]] = []

    async def _connect(self) -> trio.abc.Stream:
        if self.endpoint.unix_path is not None:
            return await trio.open_unix_socket(self.endpoint.unix_path)
        assert self.endpoint.tcp is not None
        host, port = self.endpoint.tcp
        return await trio.open_tcp_stream(host, port)

    async def post(self, body: bytes, cap: int) -> bytes:
        """The answer's body bytes (any HTTP status); NoAnswer on any transport failure."""
        try:
            with trio.fail_after(TIMEOUT_SECONDS):
                return await self._post(body, cap)
        except trio.TooSlowError:
            raise NoAnswer("timeout") from None
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError,
                h11.ProtocolError) as exc:
            raise NoAnswer(f"transport:{type(exc).__name__}") from None

    async def _reuse_or_connect(self) -> tuple[trio.abc.Stream, h11.Connection]:
        # As an HTTP client's pool does (urllib3's is_connection_dropped): an idle
        # connection that is readable has been closed by the host (or holds bytes nobody
        # asked for), and a request sent down it would be lost to a race we made.
        while self._idle:
            stream, conn = self._idle.pop()
            if not _readable(stream):
                return stream, conn
            await trio.aclose_forcefully(stream)
        return await self._connect(), h11.Connection(h11.CLIENT)

    async def _post(self, body: bytes, cap: int) -> bytes:
        stream, conn = await self._reuse_or_connect()
        reusable = False
        try:
            await stream.send_all(
                conn.send(h11.Request(method="POST", target=self.endpoint.path_prefix + "/v1/action",
                                      headers=[("Host", self.endpoint.host_header),
                                               ("Authorization", self._auth),
                                               ("Content-Type", "application/json"),
                                               ("Content-Length", str(len(body)))]))
                + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            chunks: list[bytes] = []
            size = 0
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(_RECEIVE)))
                elif isinstance(event, h11.Response):
                    length = dict(event.headers).get(b"content-length")
                    if length is not None and int(length) > cap:
                        raise NoAnswer("over the answer cap (Content-Length)")
                elif isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > cap:
                        raise NoAnswer("over the answer cap")
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                        conn.start_next_cycle()
                        reusable = True
                    return b"".join(chunks)
                elif isinstance(event, h11.ConnectionClosed):
                    raise NoAnswer("closed before an answer")
        finally:
            if reusable:
                self._idle.append((stream, conn))
            else:
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(stream)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for stream, _conn in idle:
            await trio.aclose_forcefully(stream)


def _readable(stream: trio.abc.Stream) -> bool:
    """Whether `stream` has something to read now, without reading it."""
    assert isinstance(stream, trio.SocketStream)
    readable, _, _ = select.select([stream.socket.fileno()], [], [], 0)
    return bool(readable)


# ------------------------------------------------------------------ the strict reader


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # built in C; a duplicate member makes it shorter than the pairs
    if len(out) != len(pairs):
        keys = [k for k, _ in pairs]
        key = next(k for k in keys if keys.count(k) > 1)
        raise NoAnswer(f"duplicate member {key!r}")
    return out


def _no_constant(name: str) -> Any:
    raise NoAnswer(f"{name} is not JSON")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Lower-case hex, matched in C: the per-character loop it replaced was three quarters of
#: the generator's CPU (3.0 ms of every 100-event read), which the benchmark's host shares.
_HEX = re.compile(r"[0-9a-f]*")


def _is_hex(value: Any, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and _HEX.fullmatch(value) is not None


def _exact(obj: Any, required: frozenset[str], optional: frozenset[str] = frozenset()) -> bool:
    return isinstance(obj, dict) and required <= obj.keys() <= required | optional


def _published(kind: int) -> Callable[[Any, Mapping[str, Any]], bool]:
    def check(outcome: Any, _args: Mapping[str, Any]) -> bool:
        return (_exact(outcome, frozenset({"eventId", "kind", "createdAt"}))
                and _is_hex(outcome["eventId"], 64) and outcome["kind"] == kind
                and _is_int(outcome["kind"]) and _is_int(outcome["createdAt"]))
    return check


def _event_shape(event: Any) -> bool:
    if not _exact(event, EVENT_MEMBERS):
        return False
    tags = event["tags"]
    if not (_is_hex(event["id"], 64) and _is_hex(event["pubkey"], 64)
            and _is_hex(event["sig"], 128)
            and _is_int(event["created_at"]) and _is_int(event["kind"])
            and isinstance(event["content"], str) and isinstance(tags, list)):
        return False
    for tag in tags:
        if not isinstance(tag, list):
            return False
        for value in tag:
            if not isinstance(value, str):
                return False
    return True


def _page(outcome: Any, args: Mapping[str, Any]) -> bool:
    if not _exact(outcome, frozenset({"messages"}), frozenset({"nextCursor"})):
        return False
    cursor = outcome.get("nextCursor")
    if cursor is not None and not (isinstance(cursor, str) and cursor):
        return False
    messages = outcome["messages"]
    return (isinstance(messages, list) and len(messages) <= args.get("limit", POLL_LIMIT)
            and all(_event_shape(e) for e in messages))


def _address(outcome: Any, _args: Mapping[str, Any]) -> bool:
    return (_exact(outcome, frozenset({"authorPubkey", "kind", "dTag"}))
            and _is_hex(outcome["authorPubkey"], 64) and outcome["kind"] == 30174
            and _is_int(outcome["kind"]) and _is_hex(outcome["dTag"], 64))


def _memory(outcome: Any, _args: Mapping[str, Any]) -> bool:
    return _exact(outcome, frozenset(), frozenset({"value"})) and all(
        isinstance(v, str) for v in outcome.values())


def _accepted(outcome: Any, args: Mapping[str, Any]) -> bool:
    return (_exact(outcome, frozenset({"accepted"})) and _is_int(outcome["accepted"])
            and 0 <= outcome["accepted"] <= len(args["frames"]))


#: Each action this fleet sends, and the outcome shape its answer must have.
OUTCOMES: Mapping[str, Callable[[Any, Mapping[str, Any]], bool]] = {
    "channel.read": _page,
    "storage.address": _address,
    "storage.get": _memory,
    "message.post": _published(9),
    "presence.set": _published(20001),
    "typing.set": _published(20002),
    "liveness.ping": _published(24200),
    "observer.emit": _accepted,
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """A valid envelope for our request."""

    status: str  # succeeded | failed | indeterminate
    code: str | None
    outcome: Mapping[str, Any]
    replayed: bool

    @property
    def label(self) -> str:
        return self.status if self.code is None else f"{self.status}:{self.code}"


def read_answer(raw: bytes, request_id: str, action: str, args: Mapping[str, Any]) -> Verdict:
    """Buzz's strict reading of one answer; NoAnswer when it fails any check."""
    try:
        parsed = json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except ValueError:
        raise NoAnswer("not JSON") from None
    if not isinstance(parsed, dict):
        raise NoAnswer("not an object")
    status = parsed.get("status")
    if status not in MEMBERS or not _exact(parsed, frozenset(MEMBERS[status]),
                                           frozenset({"replayed"})):
        raise NoAnswer("member set")
    replayed = parsed.get("replayed", False)
    if (parsed["type"] != "broker_result" or parsed["protocolVersion"] != 1
            or not _is_int(parsed["protocolVersion"]) or not isinstance(replayed, bool)):
        raise NoAnswer("envelope")
    if parsed["requestId"] != request_id:
        raise NoAnswer("another requestId")
    if status == "succeeded":
        if parsed["action"] != action or not OUTCOMES[action](parsed["outcome"], args):
            raise NoAnswer(f"{action} outcome")
        return Verdict(status, None, parsed["outcome"], replayed)
    error = parsed["error"]
    if not (_exact(error, frozenset({"code", "message"})) and isinstance(error["code"], str)
            and isinstance(error["message"], str)):
        raise NoAnswer("error member")
    allowed = FAILED_CODES if status == "failed" else INDETERMINATE_CODES
    if error["code"] not in allowed:
        raise NoAnswer("status/code pairing")
    return Verdict(status, error["code"], {}, replayed)


# ------------------------------------------------------------------ events

#: (id, pubkey, sig) of events whose id and signature verified in this process (see the
#: module docstring: the generator's shortcut). Bounded: oldest forgotten first.
VERIFIED: OrderedDict[tuple[str, str, str], None] = OrderedDict()
VERIFIED_MAX = 200_000


def event_id(event: Mapping[str, Any]) -> str:
    """NIP-01: sha256 of the compact JSON array [0, pubkey, created_at, kind, tags, content]."""
    serial = json.dumps([0, event["pubkey"], event["created_at"], event["kind"], event["tags"],
                         event["content"]], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(serial.encode("utf-8")).hexdigest()


def verified(event: Mapping[str, Any]) -> bool:
    key = (event["id"], event["pubkey"], event["sig"])
    if key in VERIFIED:
        return True
    if event_id(event) != event["id"]:
        return False
    try:
        ok = coincurve.PublicKeyXOnly(bytes.fromhex(event["pubkey"])).verify(
            bytes.fromhex(event["sig"]), bytes.fromhex(event["id"]))
    except ValueError:
        return False
    if ok:
        VERIFIED[key] = None
        if len(VERIFIED) > VERIFIED_MAX:
            VERIFIED.popitem(last=False)
    return bool(ok)


class Dedup:
    """Two rotating sets of ids, as the runtime keeps: an id is new unless either holds it."""

    def __init__(self, size: int = DEDUP_SET_SIZE) -> None:
        self.size = size
        self.current: set[str] = set()
        self.previous: set[str] = set()

    def first_time(self, event_id: str) -> bool:
        if event_id in self.current or event_id in self.previous:
            return False
        self.current.add(event_id)
        if len(self.current) >= self.size:
            self.previous, self.current = self.current, set()
        return True


# ------------------------------------------------------------------ the agent


@dataclass
class AgentStats:
    """What one agent saw; the test asserts on it, the benchmark sums it."""

    scheduled: int = 0          # poll ticks, sent or not
    skipped: int = 0            # ticks whose previous poll of that channel was still in flight
    sent: int = 0               # polls sent (each gets an answer or a no_answer count)
    answers: Counter[str] = field(default_factory=Counter)  # "action status[:code]"
    no_answer: Counter[str] = field(default_factory=Counter)  # "action reason"
    poll_latencies: list[float] = field(default_factory=list)  # seconds, from the tick
    delivered: dict[str, list[str]] = field(default_factory=dict)  # channel -> new ids, in order
    duplicates: int = 0         # events dropped as already seen
    dropped: int = 0            # events dropped: signature, or first h tag not the channel
    turns: int = 0
    #: With `log=True`: each call as (wall-clock start, seconds, action, label), a poll's
    #: seconds counted from its tick; each tick as (wall-clock, sent). The benchmark cuts
    #: its measurement window out of these.
    calls: list[tuple[float, float, str, str]] = field(default_factory=list)
    ticks: list[tuple[float, bool]] = field(default_factory=list)
    #: With `log=True`: each answered call as (wall-clock start, action, seconds from the
    #: request's first byte sent to its answer's last byte received): the host's part of
    #: the latency, without this generator's own lag (a late tick, the strict reading).
    wire: list[tuple[float, str, float]] = field(default_factory=list)


class BuzzAgent:
    """One agent runtime in broker mode. `run()` returns when stopped or unauthenticated."""

    def __init__(self, base: str, credential: str, channels: Sequence[str], *,
                 interval: float = DEFAULT_INTERVAL, mentions_only: Mapping[str, bool] | None = None,
                 keep_ids: bool = True, log: bool = False,
                 poll_clock: Callable[[], float] = trio.current_time,
                 timer_origin: str = "start") -> None:
        if not channels:
            raise ValueError("an agent polls at least one channel")
        self.transport = Transport(parse_endpoint(base), credential)
        self.channels = list(channels)
        self.interval = max(MIN_INTERVAL, interval)
        if timer_origin not in TIMER_ORIGINS:
            raise ValueError(f"timer_origin is one of {TIMER_ORIGINS}")
        self.timer_origin = timer_origin
        self.mentions_only = dict(mentions_only or {})
        self.keep_ids = keep_ids
        self.log = log
        self.pubkey: str | None = None
        self.memory: Mapping[str, Any] | None = None
        self.ended: str | None = None       # "unauthenticated" | "start failed: …" | "stopped"
        self.started = trio.Event()
        self.stats = AgentStats(delivered={c: [] for c in self.channels})
        self._dedup = Dedup()
        self._stop = trio.Event()
        self._turn_seq = 0
        self._unauthenticated = False
        self._clock = poll_clock

    def stop(self) -> None:
        """End cleanly: polls stop, `presence.set offline`, then `run()` returns."""
        self._stop.set()

    async def call(self, action: str, args: Mapping[str, Any],
                   since: float | None = None) -> Verdict | None:
        """One request with a fresh UUIDv4: its verdict, or None for no answer (counted).
        `unauthenticated` ends the agent. `since`: the clock reading latency counts from."""
        wall, began = time.time(), self._clock() if since is None else since
        request_id = str(uuid.uuid4())
        body = json.dumps({"type": "broker_request", "protocolVersion": 1,
                           "requestId": request_id, "actionVersion": 1, "action": action,
                           "args": dict(args)}, separators=(",", ":"),
                          ensure_ascii=False).encode("utf-8")
        try:
            sent = self._clock()
            raw = await self.transport.post(body, response_cap(action, args))
            if self.log:
                self.stats.wire.append((wall, action, self._clock() - sent))
            verdict = read_answer(raw, request_id, action, args)
        except NoAnswer as exc:
            self.stats.no_answer[f"{action} {exc}"] += 1
            if self.log:
                self.stats.calls.append((wall, self._clock() - began, action, f"no answer: {exc}"))
            return None
        self.stats.answers[f"{action} {verdict.label}"] += 1
        if self.log:
            self.stats.calls.append((wall, self._clock() - began, action, verdict.label))
        if verdict.code == "unauthenticated":
            self.ended = self.ended or "unauthenticated"
            self._stop.set()
            self._unauthenticated = True
        return verdict

    async def run(self) -> None:
        began = self._clock()
        try:
            address = await self.call("storage.address", {"slug": "core"})
            if address is None or address.status != "succeeded":
                self.ended = self.ended or f"start failed: {address.label if address else 'no answer'}"
                return
            self.pubkey = str(address.outcome["authorPubkey"])
            memory = await self.call("storage.get", {"slug": "core"})
            if memory is None or memory.status != "succeeded":
                self.ended = self.ended or f"start failed: {memory.label if memory else 'no answer'}"
                return
            self.memory = memory.outcome
            await self.call("presence.set", {"status": "online"})
            if self._stop.is_set():
                return
            self.started.set()
            origin = began if self.timer_origin == "start" else self._clock()
            # Each channel's loop stops scheduling at stop() and waits for its poll in
            # flight, so every poll sent is answered (or counted as no answer).
            async with trio.open_nursery() as nursery:
                for channel in self.channels:
                    nursery.start_soon(self._poll_channel, channel, origin)
            if not self._unauthenticated:
                await self.call("presence.set", {"status": "offline"})
                self.ended = self.ended or "stopped"
        finally:
            self.started.set()  # a waiter learns the agent ended instead of hanging
            with trio.CancelScope(shield=True):
                await self.transport.aclose()

    async def _poll_channel(self, channel: str, origin: float) -> None:
        cursor: str | None = None
        first = True
        in_flight = False
        # The first tick not before now: a timer started at `origin` has its phase.
        due = max(0, math.ceil((self._clock() - origin) / self.interval))
        async with trio.open_nursery() as nursery:
            for tick in itertools.count(due):
                intended = origin + tick * self.interval
                with trio.move_on_at(intended):
                    await self._stop.wait()
                if self._stop.is_set():
                    break
                self.stats.scheduled += 1
                if self.log:
                    self.stats.ticks.append((time.time(), not in_flight))
                if in_flight:
                    self.stats.skipped += 1
                    continue

                async def poll(intended: float = intended) -> None:
                    nonlocal cursor, first, in_flight
                    in_flight = True
                    self.stats.sent += 1
                    try:
                        args: dict[str, Any] = {"channelId": channel, "limit": POLL_LIMIT}
                        if self.mentions_only.get(channel):
                            args["mentionsOnly"] = True
                        if cursor is not None:
                            args["cursor"] = cursor
                        verdict = await self.call("channel.read", args, since=intended)
                        self.stats.poll_latencies.append(self._clock() - intended)
                        if verdict is None or verdict.status != "succeeded":
                            cursor = None  # a failed continuation is dropped: default window next
                            return
                        cursor = verdict.outcome.get("nextCursor")
                        mentioned = self._take(channel, verdict.outcome["messages"], first)
                        first = False
                        if mentioned:
                            await self._turn(channel)
                    finally:
                        in_flight = False

                nursery.start_soon(poll)

    def _take(self, channel: str, messages: Sequence[Mapping[str, Any]], backlog: bool) -> bool:
        """Keep each new event once; True when a new one (not backlog) mentions this agent."""
        mentioned = False
        for event in messages:
            first_h = next((t[1] for t in event["tags"] if len(t) > 1 and t[0] == "h"), None)
            if first_h != channel or not verified(event):
                self.stats.dropped += 1
                continue
            if not self._dedup.first_time(event["id"]):
                self.stats.duplicates += 1
                continue
            if self.keep_ids:
                self.stats.delivered[channel].append(event["id"])
            if not backlog and event["pubkey"] != self.pubkey and any(
                    len(t) > 1 and t[0] == "p" and t[1] == self.pubkey for t in event["tags"]):
                mentioned = True
        return mentioned

    async def _turn(self, channel: str) -> None:
        """What a woken runtime tells the host while it works on a mention."""
        self.stats.turns += 1
        self._turn_seq += 1
        turn_id = f"turn-{self._turn_seq}"
        await self.call("typing.set", {"channelId": channel})
        await self.call("observer.emit", {"frames": [
            {"kind": "turn_started", "payload": json.dumps({"turnId": turn_id})},
            {"kind": "acp_read", "payload": json.dumps(
                {"jsonrpc": "2.0", "method": "session/update", "params": {"turnId": turn_id}})}]})
        await self.call("liveness.ping", {"channelId": channel, "turnId": turn_id})


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds() -> float:
    """This process's own CPU (user + system), for the generator's figure."""
    return time.process_time()
