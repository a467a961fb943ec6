"""The broker as a Nostr client: NIP-01 over WebSocket with NIP-42 AUTH (trio-websocket).

Rules:
- `RelayPool` is the only thing in the daemon that talks to the relay. Message encoding
  and strict parsing live in `daemon.relay.protocol` (sans-IO); this module owns sockets,
  tasks, timeouts and the mapping of what happened to a `PublishResult`.
- Ownership: `await nursery.start(pool.run)` starts the pool; every connection task runs
  in the pool's own nursery and ends when `run` is cancelled. `publish`/`query` before
  `run` has started (or after it ended) is a bug: RuntimeError.
- Transport: ``wss://`` anywhere, ``ws://`` only to loopback, refused in the constructor
  (ValueError). TCP_NODELAY on our socket; TCP_QUICKACK re-armed after every read (see
  below).
- AUTH (NIP-42) is per connection and per pubkey. The relay may send ``["AUTH", c]`` at
  connect (Buzz does) or only after refusing something with ``auth-required:``
  (nostr-sdk's LocalRelay does). A challenge already seen is answered before the next
  EVENT/REQ is sent; an ``auth-required:`` answer makes us authenticate and resend
  *once*. The AUTH event's ``relay`` tag is the configured URL exactly as written. A
  signer that cannot sign for its own reasons (custody down) is not the relay failing:
  that fault reaches the caller as it is (`AuthNotSigned`).
- One AUTH per challenge, and one EVENT (one REQ) in flight until the relay has answered
  one EVENT (one REQ) of ours without ``auth-required:``, or accepted our AUTH
  (`daemon.relay.gate.AuthGate`, one gate per kind: a burst on a fresh connection would
  draw a challenge per refusal, and LocalRelay forgets them past 20; a relay may guard
  writes and not reads). A request waiting there gives up with its own timeout:
  ``timeouts.ok`` for a publish (NotSent), ``timeouts.eose`` for a query
  (RelayUnavailable). A challenge the relay refused is not answered again: the
  connection is retired (new requests open a new connection, with a new challenge) and
  closes when its last user leaves. An AUTH refused after the relay sent a newer
  challenge (each request in flight drew one) is followed by one AUTH for the newest.
- Publishing maps to four results, and nothing else (spec: issue 5 "Mapping"):
    OK true (``duplicate:`` included)              -> Accepted(duplicate, message)
    OK false with a reason                         -> Rejected(reason)
    nothing could be sent (unreachable, AUTH failed before sending, or the EVENT's turn
      to be written did not come within ``timeouts.ok``)    -> NotSent(reason)
    sent, or partly, then no OK before ``timeouts.ok`` (the write counts in it) or the
      connection dropped                                    -> Unknown(reason)
  Many publishes may share one connection; OKs are matched to them by event id.
- Writing: frames take turns on a connection, each written whole (`_Connection.send`).
  Every write is inside the timeout of the answer it waits for (``timeouts.ok`` for
  EVENT and AUTH, ``timeouts.eose`` for REQ, _CLEANUP_SECONDS for CLOSE): a relay that
  accepts and stops reading fills the socket buffers, and the write would otherwise
  wait forever, and every request behind it. A write cut off midway (its deadline, a
  cancelled caller) leaves part of a frame on the wire, so the connection is closed at
  once (no close handshake) and everything on it resolves (Unknown / NotSent /
  RelayUnavailable, as above).
- Reading: REQ with a subscription id unique on the connection, events until EOSE, then
  CLOSE -- always (unless nothing of the REQ was written), also after a timeout, a CLOSED
  or a cancellation (best effort, shielded and bounded). No EOSE within ``timeouts.eose``
  -> RelayUnavailable; CLOSED ``restricted:`` (or any CLOSED other than a first
  ``auth-required:``) -> RelayRefused.
  Events are returned as the relay sent them (parsed dicts); the read path verifies them.
- Memory a relay can make us hold: one frame <= MAX_FRAME_CHARS characters, which is
  MAX_FRAME_BYTES (4 MiB: a character is up to 4 bytes). Frames on their way in, every
  connection together, <= ``max_receive_bytes`` plus _UNMETERED_BYTES and a 4 KiB chunk per
  connection (`_ReceiveSlots`): a connection whose message trio-websocket is still
  assembling grows past _UNMETERED_BYTES (16 KiB) holds a slot, one frame's worst case,
  until our reader takes the message; without a slot it waits for one without reading (TCP
  holds the relay back). trio-websocket keeps no finished frame queued (_MESSAGE_QUEUE 0),
  and our reader drops each frame before it waits for the next (`_take`). No setting bounds
  the connections (one per agent in use, `idle_seconds`), so the bound is pool-wide, not per
  connection. An agent's connect lock lives only while a task connects it or waits to
  (`_forget_lock`), so an idle pool holds none. A message must arrive whole within the
  larger of ``timeouts.ok`` and ``timeouts.eose`` of taking its slot, or its connection ends
  (`_MeteredStream`): a connection stopped mid-frame gives its slot back.
  One query <= MAX_EVENTS_PER_QUERY events and MAX_QUERY_BYTES bytes of *decoded*
  events (`decoded_size`: what the parsed dicts take, not the frame's characters: a
  1 MiB frame of 170,000 one-letter tags decodes to ~16 MiB); and every
  query of the pool together <= ``max_result_bytes`` decoded bytes (`_ResultBudget`),
  counted from the first event until the caller drops the list `query` returned. Past
  either bound the query fails (RelayUnavailable) and what it had collected is dropped at
  once. Only the frame being parsed is held beyond them (one at a time: parsing does not
  yield to other tasks), and the parsed events of recent live EVENT frames, at most
  EVENT_BODIES_BYTES together as held (`_EventBodies`: a frame whose bytes after its
  subscription id are one of theirs is not parsed again).
- Logs a relay can drive: its NOTICEs, at most one line a minute per agent's connection
  (`daemon.fault_log.FaultLog`, with the count of those not written); and what a
  connection's life logs, and a full result budget (`_RELAY_LINES`), one line a minute
  per agent and event: a relay that refuses every AUTH, or breaks every connection,
  costs each request a connection, and one that forgets every AUTH costs each request
  an AUTH.
- Relay text we keep or show (a CLOSED's message, an AUTH refusal, a NOTICE, a protocol
  error's detail) is cut where it enters, by `daemon.relay.protocol.quote_reason`: at
  most MAX_REASON_CHARS printable characters in a RelayRefused's or RelayUnavailable's
  reason, on a connection, or in a log line, however long the relay's message (a frame
  may be 1 Mi characters). An OK's message reaches `Rejected`/`Accepted` whole: the
  publisher quotes it the same way before it shows it (daemon/pipeline/publisher.py).
- A relay that breaks NIP-01 (a frame `parse_relay_message` refuses) loses its
  connection: everything waiting on it resolves at once (Unknown / RelayUnavailable)
  instead of waiting for a timeout that a broken peer makes meaningless.
- Reconnection: connections are opened on demand. A failed connect is the network, TLS,
  or a WebSocket upgrade refused or malformed (`_CONNECT_ERRORS`, `_HANDSHAKE_ERRORS`,
  also inside trio-websocket's ExceptionGroup). After a failed connect the next
  attempt waits an exponential backoff (``backoff_initial`` doubling to ``backoff_max``,
  shared by the whole pool: the relay is one host). A caller never waits for a backoff
  longer than its own connect timeout; it gets NotSent / RelayUnavailable instead.

Connections: one per agent identity, kept warm, closed after ``idle_seconds`` unused.
Measured with benchmarks/relay_connections.py against nostr-sdk's LocalRelay 0.45
(NIP-42 required) on loopback, this machine (2 shared cores, so figures are noisy):
  * per-agent connection: first publish of an agent (TCP + WebSocket + refused EVENT +
    AUTH + resend) p50 2.3-3.9 ms; every later publish on the warm connection p50
    0.36-0.54 ms. 16 agents x 10-20 events concurrently: 1,500-2,200 events/s.
  * one shared connection re-authenticated per agent: impossible on LocalRelay. It
    accepts one AUTH per challenge ("auth-required: received invalid challenge" for the
    second), and once authenticated it sends no new challenge, so there is nothing to
    re-authenticate with. (It also accepts EVENTs from *any* author once one pubkey has
    authenticated; Buzz binds AUTH to the pubkey, so the broker cannot rely on that.)
    Where a relay does allow it, every switch of agent costs an AUTH round trip and all
    agents are serialized on one connection.
  So: per-agent connections. They cost one setup (~3 ms) per agent per idle period and
  one socket per active agent, stay correct whatever a relay does with repeated AUTHs,
  and let agents publish concurrently.

TCP_QUICKACK: LocalRelay does not set TCP_NODELAY on accepted sockets, so its second
small frame (EOSE after an EVENT, an EVENT after an OK) waits for our delayed ACK.
Measured (same benchmark, query returning one event = EVENT + EOSE): p50 44.0 ms without
quick ACKs, 0.65 ms with TCP_QUICKACK re-armed after every read. It costs one setsockopt
per read and is harmless against a relay that does set TCP_NODELAY, so it is on by
default; ``tcp_quickack=False`` switches it off (for measuring).

Cancellation: cancelling `publish` after its EVENT left is an Unknown for the caller's
purposes (the ledger keeps the pending record); cancelling `query` still sends CLOSE.
Cancelling either while its frame is being written closes the connection (see Writing).

WARNING: `_Connection.mark_dead` must wake every waiter kind that `_Connection` keeps
(OK waiters, subscriptions, the challenge event, the AUTH gates' queues); a waiter added
without it there would hang until its timeout after a drop.
"""

from __future__ import annotations

import logging
import math
import socket
import sqlite3
import ssl
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Union, cast

import h11
import trio
import trio_websocket
import wsproto.utilities

from buzzwire.nostr import SignedEvent

from daemon.fault_log import FaultLog, FaultLogs
from daemon.log import log_event
from daemon.relay.gate import AuthGate
from daemon.relay.protocol import (
    AuthChallenge,
    Closed,
    EndOfStoredEvents,
    EventMessage,
    Notice,
    Ok,
    Prefix,
    RelayMessage,
    RelayProtocolError,
    RelayUrl,
    check_relay_url,
    encode_auth,
    encode_close,
    encode_event,
    encode_req,
    parse_relay_message,
    quote_reason,
    split_event_frame,
    subscription_id,
)

__all__ = [
    "Accepted",
    "AnswerTooLarge",
    "AuthNotSigned",
    "PublishedMark",
    "PublishedVersions",
    "AuthSigner",
    "NotSent",
    "PublishResult",
    "Rejected",
    "RelayError",
    "RelayPool",
    "RelayRefused",
    "RelayTimeouts",
    "RelayUnavailable",
    "LiveSink",
    "LiveSubscription",
    "SubscriptionsFull",
    "Unknown",
    "decoded_size",
]

if TYPE_CHECKING:
    from daemon.relay.windows import WindowCache

_logger = logging.getLogger("buzz_broker.relay")

#: Largest frame we accept, in characters: Buzz's relay sends frames up to 512 KiB
#: (../shared/spec/buzz-on-the-relay.md); twice that is room for a relay with a larger
#: cap without letting one frame take unbounded memory. Characters, not bytes: for a text
#: frame trio-websocket's ``max_message_size`` counts ``len`` of the decoded str
#: (trio_websocket/_impl.py `_handle_message_event`, 0.12.2), and past it closes the
#: connection with 1009 (RFC 6455 §7.4.1).
MAX_FRAME_CHARS = 1024 * 1024
#: Bytes one character can take: 4 in UTF-8 on the wire (RFC 3629 §3), and 4 in a CPython
#: str holding any character past U+FFFF (PEP 393).
_MAX_BYTES_PER_CHAR = 4
#: What one frame can take, in bytes on the wire and in memory (4 MiB): the bound
#: MAX_FRAME_CHARS implies, not a second limit. A limit of MAX_FRAME_CHARS // 4 characters,
#: to make 1 MiB true in bytes, was weighed and rejected: it would refuse an honest frame
#: of Buzz's (512 KiB of ASCII is 512 Ki characters). Counting bytes as they arrive would
#: take a change to trio-websocket.
MAX_FRAME_BYTES = _MAX_BYTES_PER_CHAR * MAX_FRAME_CHARS
#: Most events one query collects before the relay is treated as broken: Buzz caps a
#: filter at 500 results, and the read path never sends more than a few filters.
MAX_EVENTS_PER_QUERY = 5_000
#: Bytes of EVENT frames one query may collect before the relay is treated as broken:
#: without it a relay could fill MAX_EVENTS_PER_QUERY events of MAX_FRAME_CHARS each (5 G
#: characters) into one read. An honest page is far smaller
#: (daemon/operations/channel_read.py cuts a page at MAX_PAGE_BYTES), but a member's
#: tag-heavy messages are not: a query past it raises AnswerTooLarge, and paging asks again
#: with a smaller `limit` (daemon/relay/paging.py "Answers too large").
MAX_QUERY_BYTES = 16 * 1024 * 1024
#: Default of ``[relay] max_result_bytes``: decoded bytes every query of the pool may hold
#: together. Without it the per-query bound multiplies by the concurrent reads the HTTP
#: caps admit (128 per uid): ~2 GiB per uid, and under mlockall an OOM kill. Four queries
#: at their bound fit; an honest page is far smaller, so honest reads rarely share it.
DEFAULT_RESULT_BYTES = 4 * MAX_QUERY_BYTES
#: Default of ``[relay] max_live_subscriptions``: live subscriptions (read windows,
#: daemon/relay/windows.py) one agent's connection holds at most. Relays cap subscriptions
#: per connection (strfry 20, nostr-rs-relay 32 by default); eight leaves room for the
#: short-lived REQs of reads and lookups on the same connection.
DEFAULT_LIVE_SUBSCRIPTIONS = 8
#: Bytes (as held: the text and its parsed objects) of the recent live EVENT frames' events
#: kept parsed (`_EventBodies`): a fleet's 64 copies of one post arrive within
#: milliseconds of each other, so a few thousand events' worth is plenty.
EVENT_BODIES_BYTES = 4 * 1024 * 1024
#: Frames trio-websocket may hold finished between its reader and ours: none. Its reader
#: hands each frame to ours and waits until ours takes it, reading nothing meanwhile, so
#: a relay that sends faster than we parse is held back by TCP, not queued here. With 16,
#: a flood of NOTICEs of 1 Mi four-byte characters held ~13 MiB per agent's connection
#: (64 connections: 44 -> 858 MiB RSS), up to 16 x MAX_FRAME_BYTES each. Measured with
#: benchmarks/relay_connections.py and read.py, 0 costs honest traffic nothing above the
#: noise; the pool's CPU, at most ~2 us a frame, the hand-over between the two tasks
#: (docs/performance.md, "Relay frames"). A queue of 1 or more would hold finished frames
#: `_MeteredStream` cannot see, so its slots would no longer bound them.
_MESSAGE_QUEUE = 0
#: Default of ``[relay] max_receive_bytes``: bytes of relay frames every connection
#: together may hold while they arrive, counted at their worst (`_ReceiveSlots`): eight
#: connections receive a frame at once, the rest wait their turn with the relay's bytes
#: left in the kernel. Honest frames arrive whole in one or two reads and are taken at
#: once, so a turn lasts microseconds; 32 MiB is what eight connections flooded with the
#: largest frames hold, instead of what every agent's connection does.
DEFAULT_RECEIVE_BYTES = 8 * MAX_FRAME_BYTES
#: Bytes of a message a connection receives without a turn (`_MeteredStream`): NIP-01's
#: answers (OK, EOSE, CLOSED, AUTH), the WebSocket handshake and most events are far
#: smaller, and must not wait behind other connections' 4 MiB frames (with every message
#: taking a turn, a relay flooding 60 connections held each new connection's handshake
#: and EOSE seconds apart: 64 connections took minutes to open). Per connection without
#: a turn, this and the chunk being read (4 KiB) is all it holds.
_UNMETERED_BYTES = 16 * 1024
#: AUTHs one authentication may send: the first, and one for the newest challenge when
#: the relay replaced the first before refusing it (`RelayPool._authenticate`). No more:
#: a relay that replaces its challenge every time does not keep us answering.
_AUTH_ANSWERS = 2
#: What the pool logs that a relay decides how often happens, at what level (module
#: docstring, "Logs a relay can drive"): each is one line a minute per agent.
_RELAY_LINES: Mapping[str, int] = {
    "relay_connected": logging.INFO,
    "relay_authenticated": logging.INFO,
    "relay_auth_superseded": logging.INFO,
    "relay_auth_refused": logging.WARNING,
    "relay_protocol_error": logging.WARNING,
    "relay_connection_error": logging.WARNING,
    "relay_disconnected": logging.INFO,
    "relay_result_budget_full": logging.WARNING,
}
#: Agents whose lines are kept apart (a host's fleet); past them the rest
#: share one line a minute per event (`FaultLog`'s "other").
_LINE_AGENTS = 1024
#: How long a best-effort CLOSE may take to write during cleanup.
_CLEANUP_SECONDS = 1.0
#: Why a request that waited at its connection's AUTH gate past its timeout failed.
_GATE_WAIT = "waited behind the connection's first request (AUTH)"
#: Why a frame whose turn to be written did not come within its timeout was not sent.
_BUSY = "the connection was still writing earlier frames"
#: How long we wait for the relay's answer to our WebSocket close frame before simply
#: closing TCP: nothing is lost by not waiting (every result was already decided), and a
#: stopping daemon or an idle close should not linger on a peer that is gone.
_CLOSE_HANDSHAKE_SECONDS = 0.25

#: auth_signer(agent_pubkey, relay_url, challenge, created_at) -> signed kind-22242 event.
AuthSigner = Callable[[str, str, str, int], Awaitable[SignedEvent]]


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayTimeouts:
    """Every deadline the pool applies, in seconds (defaults match the config's)."""

    #: TCP + TLS + WebSocket handshake for a new connection.
    connect: float = 5.0
    #: from sending EVENT (or AUTH), its write included, to its OK.
    ok: float = 10.0
    #: from sending REQ, its write included, to EOSE (or CLOSED).
    eose: float = 10.0
    #: a connection unused this long is closed.
    idle_seconds: float = 300.0
    #: first reconnect delay after a failed connect; doubles per failure ...
    backoff_initial: float = 0.25
    #: ... up to this.
    backoff_max: float = 30.0

    def __post_init__(self) -> None:
        for name in ("connect", "ok", "eose", "idle_seconds", "backoff_initial", "backoff_max"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"RelayTimeouts.{name} must be a positive number of seconds")
        if self.backoff_max < self.backoff_initial:
            raise ValueError("RelayTimeouts.backoff_max must be >= backoff_initial")


# --- results ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Accepted:
    """OK true. ``duplicate``: the relay already had the event (a safe retry)."""

    duplicate: bool
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected:
    """OK false: the relay refused the event; ``reason`` is its message, prefix included."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NotSent:
    """The event never left: relay unreachable, or AUTH failed before sending."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Unknown:
    """The event left, and no OK came back in time (or the connection dropped)."""

    reason: str


PublishResult = Union[Accepted, Rejected, NotSent, Unknown]


class RelayError(Exception):
    """Remote error from a query; ``reason`` is operator text. Where it quotes the relay
    (a CLOSED's message, an AUTH refusal) the quote is `quote_reason`'s, so a reason holds
    at most a few hundred characters whatever the relay sent."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RelayUnavailable(RelayError):
    """Unreachable, dropped, timed out, or broke the protocol: a retry may succeed."""


class AnswerTooLarge(RelayUnavailable):
    """The relay's answer to one query passed MAX_EVENTS_PER_QUERY events or
    MAX_QUERY_BYTES decoded bytes: the same query with a smaller `limit` may fit
    (daemon/relay/paging.py `read_page` asks again so; a member's tag-heavy messages
    must not fail every read of a channel)."""


class RelayRefused(RelayError):
    """The relay answered and refused (CLOSED restricted:, AUTH refused, ...)."""


class SubscriptionsFull(RelayError):
    """The agent's connection already holds ``max_live_subscriptions`` live
    subscriptions: the caller reads with a plain query instead."""


class AuthNotSigned(Exception):
    """The AUTH signer declines to sign the challenge.

    The signer raises this to say so; the pool answers as it does for any AUTH that did
    not succeed. `reason` names the cause's type, never its text. Anything else the signer
    raises is the caller's own fault, not the relay's (the daemon's: custody gone or
    failing, daemon/wiring.py): it reaches the caller of `publish`, `query` or
    `subscribe` as it is, and nothing is sent.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Unreachable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _AuthFailed(Exception):
    """AUTH did not succeed. ``refused``: the relay said no (vs. no answer / no challenge)."""

    def __init__(self, reason: str, *, refused: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused


# --- the socket ---------------------------------------------------------------------


class _Wrapped(trio.abc.HalfCloseableStream):
    """A stream that sends, half-closes and closes through `_inner`: what the two below
    share (each changes how it receives)."""

    _inner: trio.abc.HalfCloseableStream

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def aclose(self) -> None:
        await self._inner.aclose()


class _QuickAckStream(_Wrapped):
    """A SocketStream that re-arms TCP_QUICKACK after every read (Linux; see module doc)."""

    _inner: trio.SocketStream

    def __init__(self, inner: trio.SocketStream, quickack: bool) -> None:
        self._inner = inner
        self._quickack = quickack and hasattr(socket, "TCP_QUICKACK")
        inner.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rearm()

    def _rearm(self) -> None:
        if self._quickack:
            try:
                self._inner.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            except OSError:
                # The socket is closing; the next read will report it.
                pass

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self._inner.receive_some(max_bytes)
        self._rearm()
        return bytes(data)


class _ReceiveSlots:
    """Frames on their way in from the relay, every connection together (module docstring,
    "Memory a relay can make us hold"): ``max_receive_bytes`` // MAX_FRAME_BYTES slots,
    each one connection receiving one message past _UNMETERED_BYTES, whatever its size (a
    slot is what the largest takes; counting a frame's bytes as they come could
    deadlock, each connection halfway through a frame waiting for bytes another holds).
    Taken in turn (trio's Semaphore is FIFO)."""

    __slots__ = ("total", "_free")

    def __init__(self, max_bytes: int) -> None:
        self.total = max_bytes // MAX_FRAME_BYTES
        self._free = trio.Semaphore(self.total)

    @property
    def held(self) -> int:
        """Slots taken now."""
        return self.total - self._free.value

    async def acquire(self) -> None:
        await self._free.acquire()

    def release(self) -> None:
        self._free.release()


class _MeteredStream(_Wrapped):
    """The stream trio-websocket reads (TLS or plain, `_QuickAckStream` below), holding a
    `_ReceiveSlots` slot while trio-websocket holds more than _UNMETERED_BYTES of a
    message of this connection that our reader has not taken.

    Only trio-websocket's reader task calls `receive_some`, and with no finished frame
    queued (_MESSAGE_QUEUE 0) it calls it holding a message's beginning or nothing:
    ``ws._message_size`` tells which (trio_websocket/_impl.py `_handle_message_event`,
    0.12.2: the characters of the message being assembled, 0 between messages). It is
    private: without it every connection fails at its first read, and if its meaning
    changed tests/adversarial/test_relay_bounds.py::test_frames_held_stay_within_max_receive_bytes_however_many_connections
    fails. Holding nothing, the connection gives its slot back before it waits for the
    network: a ping, the handshake, an idle connection hold none. Bytes that would make
    the message being assembled larger than _UNMETERED_BYTES (counted at four bytes a
    character) wait for a slot before trio-websocket sees them; a smaller message needs
    none. Our reader gives the slot back as it takes a message (`release`), so a
    connection the relay keeps busy takes its turn again behind the others.

    A message must arrive whole within `frame_seconds` of its slot: a relay (or a
    half-open TCP connection) that stops in the middle of a frame would otherwise keep
    the slot for the connection's life, and every slot so held is one the other agents'
    connections never get back. The deadline is the connection's cancel scope's
    (`scope`), not a read's: trio-websocket's reader may be waiting elsewhere holding
    the slot (writing a pong to a relay that stopped reading, or its close reply), and
    the deadline must end the connection there too (its requests: RelayUnavailable /
    Unknown). Giving the slot back lifts it, so a deadline never outlives its slot.
    """

    def __init__(self, inner: trio.abc.HalfCloseableStream, slots: _ReceiveSlots,
                 frame_seconds: float) -> None:
        self._inner = inner
        self._slots = slots
        self.frame_seconds = frame_seconds
        #: Set once the handshake is done; before it, nothing is a message.
        self.ws: trio_websocket.WebSocketConnection | None = None
        #: The scope around the connection's tasks (trio-websocket's reader and ours),
        #: set with `ws`: a slot's deadline is its deadline.
        self.scope: trio.CancelScope | None = None
        self._holding = False

    @property
    def overdue(self) -> bool:
        """A slot is held past its deadline: why the connection's scope was cancelled."""
        return (self._holding and self.scope is not None
                and trio.current_time() >= self.scope.deadline)

    def release(self) -> None:
        """Give the slot back (idempotent): the message is ours, or the connection ended."""
        if self._holding:
            self._holding = False
            self._slots.release()
            if self.scope is not None:
                self.scope.deadline = math.inf

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        held = 0 if self.ws is None else _MAX_BYTES_PER_CHAR * self.ws._message_size
        if held == 0:
            self.release()
        data = await self._inner.receive_some(max_bytes)
        if not self._holding and held + len(data) > _UNMETERED_BYTES:
            assert self.scope is not None, "a message before the handshake was done"
            await self._slots.acquire()
            self._holding = True
            self.scope.deadline = trio.current_time() + self.frame_seconds
        return data

    async def aclose(self) -> None:
        self.release()
        await super().aclose()


def _check_message_size() -> None:
    """Refuse a trio-websocket without the private ``_message_size`` `_MeteredStream` reads
    (an int, 0 on a new connection): at the pool's start, not as every connection failing
    at its first read. Its meaning (the characters of the message being assembled) is
    pinned by tests/adversarial/test_relay_bounds.py::test_trio_websocket_counts_the_message_being_assembled,
    and pyproject.toml keeps trio-websocket to the versions that test passed on.
    """
    probe = trio_websocket.WebSocketConnection(
        cast(trio.SocketStream, None), wsproto.WSConnection(wsproto.ConnectionType.CLIENT),
        host="relay.invalid", path="/")
    if getattr(probe, "_message_size", None) != 0:
        raise RuntimeError(
            f"trio-websocket {trio_websocket.__version__} has no _message_size as 0.12 has: "
            "the relay pool cannot bound the frames it receives (pyproject.toml)")


# --- one connection -------------------------------------------------------------------


class _Frame:
    """One frame on its way to the relay, and how far it got: what a failure means for it
    (`_Connection.send`). ``started``: bytes of it may have left; ``written``: all did."""

    __slots__ = ("text", "started", "written")

    def __init__(self, text: str) -> None:
        self.text = text
        self.started = False
        self.written = False


class _OkWaiter:
    __slots__ = ("done", "ok", "dropped")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.ok: Ok | None = None
        self.dropped = False


class PublishedMark(Protocol):
    """One version as `PublishedVersions` keeps it."""

    @property
    def created_at(self) -> int: ...

    @property
    def event_id(self) -> str: ...


class PublishedVersions(Protocol):
    """Where the pool records each replaceable event it published (the state directory's
    daemon/state/sign_watermarks.py; the relay package knows nothing of state)."""

    def get(self, agent: str, kind: int, d: str) -> PublishedMark | None: ...

    def record(self, agent: str, kind: int, d: str, created_at: int, event_id: str) -> None:
        """Blocking (a durable commit): the pool calls it in a worker thread.
        Raises sqlite3.Error / OSError when the write fails."""


def is_replaceable(kind: int) -> bool:
    """NIP-01 replaceable (0, 3, 10000-19999) or addressable (30000-39999)."""
    return kind in (0, 3) or 10000 <= kind < 20000 or 30000 <= kind < 40000


def decoded_size(value: object) -> int:
    """Bytes the parsed JSON `value` takes in this process (sys.getsizeof of every object).

    Why not the frame's length: JSON is denser than its objects (`["a"],` is 6 characters,
    and a one-element list holding a str is ~110 bytes). Shared objects (CPython caches
    one-character strings) are counted at every use, so this over-counts, never under.
    Iterative: a relay's nesting depth must not reach the recursion limit here.
    """
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


class _ResultBudget:
    """Decoded bytes every query of one pool holds, against one process-wide total.

    Unlike the request-body budget (daemon/peer_shares.py) it cannot wait: events arrive
    as the relay sends them, and stalling the reader would stall the connection's OKs. A
    query whose next event does not fit fails instead (the read answers action_failed).
    """

    __slots__ = ("total", "used")

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0

    def take(self, size: int) -> bool:
        if self.used + size > self.total:
            return False
        self.used += size
        return True

    def give_back(self, size: int) -> None:
        self.used -= size


class _Results(list[dict[str, object]]):
    """What `query` returns: a list that can carry a finalizer, so that the budget its
    events took is given back when the caller drops it, not when `query` returns."""

    __slots__ = ("__weakref__",)


class _Subscription:
    __slots__ = ("done", "events", "size", "closed", "dropped", "overflow", "budget")

    def __init__(self, budget: _ResultBudget) -> None:
        self.done = trio.Event()
        self.events: list[dict[str, object]] = []
        #: Decoded bytes of the events collected (`decoded_size`), all taken from `budget`.
        self.size = 0
        self.closed: str | None = None
        self.dropped = False
        #: None, or what was exceeded: "query" (this query's bound) or "pool" (the budget).
        self.overflow: str | None = None
        self.budget = budget

    def collect(self, event: dict[str, object]) -> None:
        size = decoded_size(event)
        if len(self.events) >= MAX_EVENTS_PER_QUERY or self.size + size > MAX_QUERY_BYTES:
            self.overflow = "query"
        elif not self.budget.take(size):
            self.overflow = "pool"
        else:
            self.events.append(event)
            self.size += size
            return
        # The query fails: free what it held at once.
        self.budget.give_back(self.hand_over()[1])
        self.done.set()

    def hand_over(self) -> tuple[list[dict[str, object]], int]:
        """The events and the budget bytes they hold; the subscription holds nothing after."""
        events, size = self.events, self.size
        self.events, self.size = [], 0
        return events, size

    @property
    def complete(self) -> bool:
        """EOSE came and nothing went wrong: the events are the query's answer."""
        return (self.done.is_set() and self.closed is None and self.overflow is None
                and not self.dropped)

    # What the connection's reader tells a subscription (`_Connection.dispatch`).

    def on_event(self, event: dict[str, object]) -> None:
        if not self.done.is_set():
            self.collect(event)

    def on_eose(self) -> None:
        self.done.set()

    def on_closed(self, message: str) -> None:
        if not self.done.is_set():
            self.closed = message
            self.done.set()

    def on_dropped(self) -> None:
        self.dropped = True
        self.done.set()


class LiveSink(Protocol):
    """What a live subscription feeds (daemon/relay/windows.py's `Window`).

    Called from the connection's reader task, synchronously: `event` for every event the
    relay sends (``live`` False before EOSE: stored events; True after it: events the
    relay accepted since), and `ended` once when the subscription ends without our CLOSE
    (the relay's CLOSED, or the connection dropped). Neither may block or raise.
    """

    def event(self, event: dict[str, object], *, live: bool) -> None: ...

    def ended(self, reason: str) -> None: ...


class _Live:
    """A subscription kept open past EOSE; its events go to a `LiveSink`, not a list."""

    __slots__ = ("done", "closed", "dropped", "sink")

    def __init__(self, sink: LiveSink) -> None:
        self.done = trio.Event()
        self.closed: str | None = None
        self.dropped = False
        self.sink = sink

    def on_event(self, event: dict[str, object]) -> None:
        self.sink.event(event, live=self.done.is_set())

    def on_eose(self) -> None:
        self.done.set()

    def on_closed(self, message: str) -> None:
        established = self.done.is_set()
        self.closed = message
        self.done.set()
        if established:
            self.sink.ended("closed by the relay")

    def on_dropped(self) -> None:
        established = self.done.is_set() and self.closed is None and not self.dropped
        self.dropped = True
        self.done.set()
        if established:
            self.sink.ended("connection dropped")


class _EventBodies:
    """The parsed event of each recent live EVENT frame, by the frame's text after its
    subscription id (`split_event_frame`), least recently used dropped past `max_bytes`.

    Why: every agent's window subscribes to the same channels on its own connection, so
    each post arrives as many frames as there are agents, equal but for the subscription
    id; each was parsed in full. A frame whose rest is exactly one parsed before gets that
    parse's event object; any other byte and it is parsed afresh. Only live subscriptions
    (`_Live`, read windows) are handed a shared object: they only read it, where a query's
    caller owns the list of events it gets.
    """

    __slots__ = ("max_bytes", "bytes", "_entries")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[dict[str, object], int]] = OrderedDict()

    def get(self, rest: str) -> dict[str, object] | None:
        entry = self._entries.get(rest)
        if entry is None:
            return None
        self._entries.move_to_end(rest)
        return entry[0]

    def put(self, rest: str, event: dict[str, object]) -> None:
        if rest in self._entries:
            return
        cost = sys.getsizeof(rest) + decoded_size(event)
        if cost > self.max_bytes:
            return
        self._entries[rest] = (event, cost)
        self.bytes += cost
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped


class _Connection:
    """One WebSocket to the relay, used by one agent. State only; the pool drives it."""

    def __init__(self, agent: str, budget: _ResultBudget, notices: FaultLog) -> None:
        self.agent = agent
        self.budget = budget
        #: The pool's NOTICE log: a relay may send NOTICEs without end.
        self.notices = notices
        self.ws: trio_websocket.WebSocketConnection | None = None
        #: What `ws` reads from; our reader gives its `_ReceiveSlots` slot back there.
        self.stream: _MeteredStream | None = None
        self.scope: trio.CancelScope | None = None
        self.alive = False
        #: Frames take turns here, each written whole before the next starts (`send`).
        self.send_lock = trio.Lock()
        #: A write was cut off (`send`): the connection ends without a close handshake.
        self.aborted = False
        self.challenge: str | None = None
        #: Set, and replaced, whenever a challenge arrives (or the connection dies).
        self.challenge_seen = trio.Event()
        #: The last challenge we sent an AUTH for; NIP-42 allows one AUTH per challenge.
        self.answered: str | None = None
        #: The relay's refusal of the AUTH for `answered`, while no newer challenge came.
        self.refused: str | None = None
        #: The id of our AUTH event awaiting its OK (its OK opens the gates only if true).
        self.auth_pending: str | None = None
        #: One AUTH gate per kind of request: a relay may let anyone read and ask for
        #: AUTH only to write (NIP-42 allows it; LocalRelay has the mode), so an answer
        #: to a REQ says nothing about EVENTs, nor the reverse.
        self.write_gate = AuthGate()
        self.read_gate = AuthGate()
        self.authenticated = False
        #: bumped by every successful AUTH; a refusal of something sent under an older
        #: generation is answered by resending, not by authenticating again.
        self.auth_generation = 0
        self.auth_lock = trio.Lock()
        self.ok_waiters: dict[str, list[_OkWaiter]] = {}
        self.subscriptions: dict[str, _Subscription | _Live] = {}
        self.sub_counter = 0
        #: live subscriptions open on this connection (`RelayPool.subscribe`)
        self.live = 0
        self.in_use = 0
        self.last_used = trio.current_time()

    # waiters ------------------------------------------------------------------------

    def expect_ok(self, event_id: str) -> _OkWaiter:
        waiter = _OkWaiter()
        if not self.alive:
            waiter.dropped = True
            waiter.done.set()
        self.ok_waiters.setdefault(event_id, []).append(waiter)
        return waiter

    def forget_ok(self, event_id: str, waiter: _OkWaiter) -> None:
        waiters = self.ok_waiters.get(event_id)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self.ok_waiters[event_id]

    def open_subscription(self) -> tuple[str, _Subscription]:
        sub_id = subscription_id(self.sub_counter)
        self.sub_counter += 1
        sub = _Subscription(self.budget)
        if not self.alive:
            sub.dropped = True
            sub.done.set()
        self.subscriptions[sub_id] = sub
        return sub_id, sub

    def open_live(self, sink: LiveSink) -> tuple[str, _Live]:
        sub_id = subscription_id(self.sub_counter)
        self.sub_counter += 1
        live = _Live(sink)
        if not self.alive:
            live.dropped = True
            live.done.set()
        self.subscriptions[sub_id] = live
        return sub_id, live

    def mark_dead(self) -> None:
        self.alive = False
        for waiters in self.ok_waiters.values():
            for waiter in waiters:
                waiter.dropped = True
                waiter.done.set()
        for sub in list(self.subscriptions.values()):
            sub.on_dropped()
        # Wakes an AUTH waiting for a challenge, and every request waiting at a gate;
        # they then see the connection is dead.
        self.challenge_seen.set()
        self.write_gate.shut()
        self.read_gate.shut()

    # incoming ------------------------------------------------------------------------

    def dispatch(self, msg: RelayMessage) -> None:
        """Apply one relay message to the waiters (one `match`, one arm per verb)."""
        match msg:
            case Ok(event_id=event_id, accepted=accepted):
                # Our AUTH accepted opens both gates; refused, neither. An OK to an EVENT
                # we sent, not asking for AUTH, shows the relay takes writes here. An OK
                # for an event nobody waits for (never sent, or answered already) shows
                # nothing.
                waiters = self.ok_waiters.pop(event_id, [])
                if event_id == self.auth_pending:
                    if accepted:
                        self.write_gate.open()
                        self.read_gate.open()
                elif waiters and msg.prefix is not Prefix.AUTH_REQUIRED:
                    self.write_gate.open()
                for waiter in waiters:
                    waiter.ok = msg
                    waiter.done.set()
            case EventMessage(subscription_id=sub_id, event=event):
                sub = self.subscriptions.get(sub_id)
                if sub is not None:
                    sub.on_event(event)
            case EndOfStoredEvents(subscription_id=sub_id):
                # Only an answer to a REQ of ours says the relay takes reads.
                sub = self.subscriptions.get(sub_id)
                if sub is not None:
                    self.read_gate.open()
                    sub.on_eose()
            case Closed(subscription_id=sub_id, message=message):
                sub = self.subscriptions.get(sub_id)
                if sub is not None:
                    if msg.prefix is not Prefix.AUTH_REQUIRED:
                        self.read_gate.open()
                    # Cut here, where the relay's text enters: it becomes a RelayRefused's
                    # reason (`_after_closed`) and the read's log line.
                    sub.on_closed(quote_reason(message))
            case AuthChallenge(challenge=challenge):
                # A new challenge supersedes the old; NIP-42 says the latest is valid.
                if challenge != self.challenge:
                    self.challenge = challenge
                    self.refused = None
                self.challenge_seen.set()
                self.challenge_seen = trio.Event()
            case Notice(message=message):
                self.notices.record((self.agent,), agent=self.agent, notice=quote_reason(message))

    async def send(self, frame: _Frame) -> None:
        """Write `frame` whole, after every frame asked for before it.

        Waiting for the turn writes nothing: a caller that gives up there (its deadline,
        or the connection closed meanwhile) has sent nothing, `frame.started` is False.
        From `frame.started` on bytes may leave, and a write cut off there (a deadline, a
        cancelled caller, a broken socket) leaves part of a frame on the wire, after
        which no frame can be read right: the connection is aborted, and everything
        waiting on it resolves at once (`mark_dead`). A relay that stopped reading
        (its buffers and ours full) so costs each request its own timeout, not forever.

        Raises:
            trio_websocket.ConnectionClosed: closed before or while writing.
            trio.BrokenResourceError: the socket broke while writing.
        """
        async with self.send_lock:
            if self.ws is not None and self.ws.closed is not None:
                # The relay closed (or the socket broke) and our reader has not ended the
                # connection yet: nothing goes out on it now, so nobody should wait on it,
                # and the next request should connect anew.
                self.mark_dead()
            if self.ws is None or not self.alive:
                raise trio_websocket.ConnectionClosed(None)
            frame.started = True
            try:
                await self.ws.send_message(frame.text)
            except BaseException:
                self.abort()
                raise
            frame.written = True

    def abort(self) -> None:
        """End the connection now: its state on the wire is unknown (`send`)."""
        self.aborted = True
        self.mark_dead()
        if self.scope is not None:
            self.scope.cancel()


#: What a failed connect may raise: the network, TLS (trio wraps it as BrokenResourceError)
#: and the WebSocket handshake (HTTP refusal, peer closed mid-handshake).
_CONNECT_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    trio.BrokenResourceError,
    trio_websocket.HandshakeError,
    trio_websocket.ConnectionClosed,
)
#: What trio-websocket raises, from its reader task, for an upgrade reply its wsproto
#: cannot take (not HTTP, no or a wrong Sec-WebSocket-Accept, a head past h11's bound, a
#: refusal with a broken body): it answers with a server's rejection, which its client
#: side cannot send; h11's LocalProtocolError, or wsproto's once the reply was a refusal.
_HANDSHAKE_ERRORS: tuple[type[Exception], ...] = (
    h11.ProtocolError,
    wsproto.utilities.ProtocolError,
)


def _connect_error(exc: BaseException) -> str | None:
    """Operator text for a connect failure, or None when `exc` is not one (a bug)."""
    if isinstance(exc, BaseExceptionGroup):
        reasons = [_connect_error(e) for e in exc.exceptions]
        if not reasons or any(r is None for r in reasons):
            return None
        return "; ".join(r for r in reasons if r is not None)
    if isinstance(exc, _HANDSHAKE_ERRORS):
        # Their text ("can't handle event type Response ...") would only mislead.
        return f"cannot connect: malformed WebSocket handshake reply ({type(exc).__name__})"
    if isinstance(exc, _CONNECT_ERRORS):
        return f"cannot connect: {type(exc).__name__}: {exc}"[:300]
    return None


# --- the pool -------------------------------------------------------------------------


class RelayPool:
    """Connections to one relay, one per agent, for publishing and querying.

    Args:
        url: ``wss://host[:port][/path]``, or ``ws://`` to a loopback host. Used exactly as
            written in every AUTH event's ``relay`` tag.
        auth_signer: ``await auth_signer(agent, url, challenge, created_at)`` returns the
            agent's signed kind-22242 event as a dict (custody signs it).
        timeouts: every deadline; see `RelayTimeouts`.
        tcp_quickack: re-arm TCP_QUICKACK after reads (see the module docstring).
        observer: called ``observer(op, result, seconds)`` after each publish
            (result: accepted|rejected|notsent|unknown) and query (ok|refused|unavailable),
            for metrics; it sees no event, filter or agent.
        max_result_bytes: decoded bytes every query's events may hold together, from the
            first event until the caller drops the returned list (module docstring).
        max_live_subscriptions: live subscriptions (`subscribe`) one agent's connection
            may hold; past it `subscribe` raises SubscriptionsFull.
        max_receive_bytes: bytes of relay frames every connection together may hold
            while they arrive, each connection receiving one counted as MAX_FRAME_BYTES
            (module docstring); at least MAX_FRAME_BYTES.

    Raises:
        ValueError: a URL the transport rule refuses, a signer that is not callable,
            a `max_result_bytes` below MAX_QUERY_BYTES (one query at its bound must fit),
            or a `max_receive_bytes` below MAX_FRAME_BYTES (one frame must fit).
    """

    def __init__(
        self,
        url: str,
        auth_signer: AuthSigner,
        *,
        timeouts: RelayTimeouts = RelayTimeouts(),
        tcp_quickack: bool = True,
        observer: Callable[[str, str, float], None] | None = None,
        max_result_bytes: int = DEFAULT_RESULT_BYTES,
        max_live_subscriptions: int = DEFAULT_LIVE_SUBSCRIPTIONS,
        max_receive_bytes: int = DEFAULT_RECEIVE_BYTES,
    ) -> None:
        self._url: RelayUrl = check_relay_url(url)
        if max_live_subscriptions < 0:
            raise ValueError("max_live_subscriptions must be >= 0")
        self._max_live = max_live_subscriptions
        if not callable(auth_signer):
            raise ValueError("auth_signer must be an async callable")
        if max_result_bytes < MAX_QUERY_BYTES:
            raise ValueError(f"max_result_bytes must be >= {MAX_QUERY_BYTES}")
        self._budget = _ResultBudget(max_result_bytes)
        if max_receive_bytes < MAX_FRAME_BYTES:
            raise ValueError(f"max_receive_bytes must be >= {MAX_FRAME_BYTES}")
        _check_message_size()
        self._receiving = _ReceiveSlots(max_receive_bytes)
        #: Where each replaceable event published is remembered (the guard operations
        #: check before they merge, daemon/state/sign_watermarks.py); set by the wiring
        #: once the state directory is open. None: nothing remembered.
        self.watermarks: PublishedVersions | None = None
        #: A watermark write that failed after the relay's answer (a locked or full
        #: disk): logged, the verdict kept.
        self._watermark_faults = FaultLog(_logger, "relay_watermark_unrecorded",
                                          level=logging.WARNING)
        #: The read windows kept on this pool's connections (daemon/relay/windows.py); set
        #: by the wiring when ``[relay] read_window_bytes`` is not 0. None: every read
        #: goes to the relay.
        self.windows: WindowCache | None = None
        self._auth_signer = auth_signer
        self._timeouts = timeouts
        self._quickack = tcp_quickack
        self._observer = observer
        self._nursery: trio.Nursery | None = None
        self._connections: dict[str, _Connection] = {}
        self._connect_locks: dict[str, trio.Lock] = {}
        self._failures = 0
        self._retry_at = 0.0
        self._ssl = ssl.create_default_context() if self._url.secure else None
        self._bodies = _EventBodies(EVENT_BODIES_BYTES)
        # A NOTICE is text for the operator, and a relay may send them without end: one
        # line per agent's connection a minute at most, with the count of the rest.
        self._notices = FaultLog(_logger, "relay_notice", level=logging.INFO)
        self._lines = FaultLogs(_logger, _RELAY_LINES, max_causes=_LINE_AGENTS)

    @property
    def url(self) -> str:
        return self._url.text

    @property
    def frames_receiving(self) -> int:
        """Connections holding part of a relay frame now (`_ReceiveSlots`), at most
        ``max_receive_bytes`` // MAX_FRAME_BYTES."""
        return self._receiving.held

    @property
    def result_bytes_held(self) -> int:
        """Decoded bytes of relay events the pool's queries hold now (collected, or
        returned and not yet dropped by their caller)."""
        return self._budget.used

    # lifecycle ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the connection tasks until cancelled; `started()` once requests may come.

        Resource handling: on exit every connection is closed (a WebSocket close, bounded).
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._close_idle)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for conn in self._connections.values():
                conn.mark_dead()
            self._connections.clear()

    def _require_running(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError("RelayPool.run() is not running")
        return self._nursery

    async def _close_idle(self) -> None:
        period = min(self._timeouts.idle_seconds / 2, 30.0)
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            for conn in list(self._connections.values()):
                if conn.in_use == 0 and now - conn.last_used >= self._timeouts.idle_seconds:
                    log_event(_logger, "relay_idle_close", agent=conn.agent)
                    self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        conn.mark_dead()
        if self._connections.get(conn.agent) is conn:
            del self._connections[conn.agent]
        if conn.scope is not None:
            conn.scope.cancel()

    # connecting -------------------------------------------------------------------------

    @asynccontextmanager
    async def _use(self, agent: str) -> AsyncIterator[_Connection]:
        conn = await self._connection(agent)
        conn.in_use += 1
        try:
            yield conn
        finally:
            conn.in_use -= 1
            conn.last_used = trio.current_time()
            self._close_if_retired(conn)

    def _retire(self, conn: _Connection) -> None:
        """No new request goes to `conn`; it closes when its last user leaves."""
        if self._connections.get(conn.agent) is conn:
            del self._connections[conn.agent]

    def _close_if_retired(self, conn: _Connection) -> None:
        # A live connection the pool no longer lists was retired (`_retire`); once unused
        # nobody can reach it again, and the idle closer only walks the listed ones.
        if conn.in_use == 0 and conn.alive and self._connections.get(conn.agent) is not conn:
            self._drop(conn)

    async def _connection(self, agent: str) -> _Connection:
        nursery = self._require_running()
        conn = self._connections.get(agent)
        if conn is not None and conn.alive:
            return conn
        lock = self._connect_locks.setdefault(agent, trio.Lock())
        try:
            async with lock:
                return await self._connect(agent, nursery)
        finally:
            self._forget_lock(agent, lock)

    def _forget_lock(self, agent: str, lock: trio.Lock) -> None:
        """Drop `agent`'s connect lock once nobody holds it or waits for it (trio hands a
        released lock straight to its next waiter): otherwise a lock per agent ever
        connected stays for the daemon's life, one more per agents.create. Whoever comes
        next makes a new one; a task holding this one got it before any other task ran."""
        held = lock.statistics()
        if held.owner is None and not held.tasks_waiting and \
                self._connect_locks.get(agent) is lock:
            del self._connect_locks[agent]

    async def _connect(self, agent: str, nursery: trio.Nursery) -> _Connection:
        """`agent`'s connection, opened unless another task opened it first; under the
        agent's connect lock (`_connection`)."""
        conn = self._connections.get(agent)
        if conn is not None and conn.alive:
            return conn
        wait = self._retry_at - trio.current_time()
        if wait > self._timeouts.connect:
            raise _Unreachable(f"relay unreachable; next attempt in {wait:.1f}s")
        if wait > 0:
            await trio.sleep(wait)
        conn = _Connection(agent, self._budget, self._notices)
        try:
            with trio.fail_after(self._timeouts.connect):
                await nursery.start(self._serve_connection, conn)
        except trio.TooSlowError:
            self._connect_failed(agent, f"no connection within {self._timeouts.connect}s")
        except Exception as exc:
            # The handshake runs inside the connection's nursery, so its errors may
            # arrive wrapped in an ExceptionGroup; anything else is a bug and rises.
            reason = _connect_error(exc)
            if reason is None:
                raise
            self._connect_failed(agent, reason)
        self._failures = 0
        self._retry_at = 0.0
        self._connections[agent] = conn
        self._lines.record("relay_connected", agent, agent=agent, url=self._url.text)
        return conn

    def _connect_failed(self, agent: str, reason: str) -> None:
        delay = min(
            self._timeouts.backoff_max, self._timeouts.backoff_initial * 2**self._failures
        )
        # Doubling stops at the cap: counted on, 2**failures outgrows a float after 1,023
        # failures in a row (OverflowError on every request of a long outage).
        if delay < self._timeouts.backoff_max:
            self._failures += 1
        self._retry_at = trio.current_time() + delay
        log_event(
            _logger, "relay_connect_failed", level=logging.WARNING,
            agent=agent, url=self._url.text, reason=reason, retry_in=round(delay, 3),
        )
        raise _Unreachable(reason)

    async def _open_stream(self) -> trio.abc.HalfCloseableStream:
        raw = await trio.open_tcp_stream(self._url.host, self._url.port)
        stream: trio.abc.HalfCloseableStream = _QuickAckStream(raw, self._quickack)
        if self._ssl is not None:
            tls = trio.SSLStream(stream, self._ssl, server_hostname=self._url.host)
            try:
                await tls.do_handshake()
            except BaseException:
                await trio.aclose_forcefully(tls)
                raise
            return cast(trio.abc.HalfCloseableStream, tls)
        return stream

    async def _serve_connection(
        self, conn: _Connection, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """One connection's life: connect, hand it over, read until it ends, clean up."""
        stream = _MeteredStream(await self._open_stream(), self._receiving,
                                max(self._timeouts.ok, self._timeouts.eose))
        reason = "closed"
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    ws = await trio_websocket.wrap_client_stream(
                        nursery,
                        # trio-websocket only needs the Stream methods; the wrapper keeps
                        # the QUICKACK re-arm under its reads.
                        cast(trio.SocketStream, stream),
                        self._url.host_header,
                        self._url.resource,
                        message_queue_size=_MESSAGE_QUEUE,
                        max_message_size=MAX_FRAME_CHARS,
                    )
                    conn.ws, conn.scope, conn.alive = ws, scope, True
                    conn.stream, stream.ws, stream.scope = stream, ws, scope
                    task_status.started()
                    reason = await self._read(conn, ws)
                    nursery.cancel_scope.cancel()
            if conn.aborted:
                reason = "a frame's write was cut off"
            elif stream.overdue:
                reason = f"no whole frame within {stream.frame_seconds}s of its turn"
            elif scope.cancelled_caught:
                reason = "closed by the pool"
        except Exception as exc:
            # Before started(), the error belongs to the caller of start() (a failed
            # connect). After it, one broken connection must not take the pool (and
            # every other agent's connection) down: record it and end this one only.
            if conn.ws is None:
                raise
            reason = f"connection failed: {type(exc).__name__}"
            self._lines.record("relay_connection_error", conn.agent, agent=conn.agent,
                               error=type(exc).__name__)
        finally:
            # First: the connection's tasks have ended, nobody reads it any more, and the
            # close below may wait (a relay that does not read), holding a slot meanwhile.
            stream.release()
            conn.mark_dead()
            if self._connections.get(conn.agent) is conn:
                del self._connections[conn.agent]
            with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_HANDSHAKE_SECONDS):
                # After a cut-off frame a close frame would land inside it, and the relay
                # that did not read that frame would not read this one either: TCP only.
                if conn.ws is not None and not conn.aborted:
                    await conn.ws.aclose()
                await stream.aclose()
            if conn.ws is not None:
                self._lines.record("relay_disconnected", conn.agent, agent=conn.agent,
                                   reason=reason)

    async def _read(self, conn: _Connection, ws: trio_websocket.WebSocketConnection) -> str:
        while True:
            try:
                frame = await ws.get_message()
            except trio_websocket.ConnectionClosed as exc:
                return f"connection closed ({exc.reason.code if exc.reason else 'no close frame'})"
            if conn.stream is not None:
                conn.stream.release()  # the frame is ours now: trio-websocket holds none of it
            ended = self._take(conn, frame)
            # Not held while we wait for the next: the frame and what `_take` made of it
            # (a NOTICE's text) would otherwise stay with each idle connection.
            del frame
            if ended is not None:
                return ended

    def _take(self, conn: _Connection, frame: str | bytes) -> str | None:
        """Parse one frame and apply it to `conn`; why the connection ends, or None.
        Synchronous: one frame is parsed at a time in the whole pool."""
        # A live subscription's EVENT whose rest is one parsed lately: that event
        # (`_EventBodies`); any other frame is parsed in full.
        parts = split_event_frame(frame) if isinstance(frame, str) else None
        live = parts is not None and isinstance(conn.subscriptions.get(parts[0]), _Live)
        if parts is not None and live:
            event = self._bodies.get(parts[1])
            if event is not None:
                conn.dispatch(EventMessage(subscription_id=parts[0], event=event))
                return None
        try:
            msg = parse_relay_message(frame)
        except RelayProtocolError as exc:
            self._lines.record("relay_protocol_error", conn.agent, agent=conn.agent,
                               code=exc.code, detail=quote_reason(exc.detail))
            return f"protocol error ({exc.code})"
        if parts is not None and live and isinstance(msg, EventMessage):
            self._bodies.put(parts[1], msg.event)
        conn.dispatch(msg)
        return None

    # AUTH -------------------------------------------------------------------------------

    async def _authenticate(self, conn: _Connection, seen_generation: int) -> None:
        """Make `conn` authenticated as its agent (NIP-42), with one AUTH per challenge.

        Does nothing when someone else authenticated since `seen_generation` was read.
        Waits up to ``timeouts.ok`` for a challenge not answered yet. A refused AUTH
        retires the connection (module docstring), and the refusal is the answer for
        every later request on it: the challenge is spent. One refused after the relay
        sent a newer challenge is not a verdict on us (NIP-42: a challenge is valid until
        the next is sent; a relay that challenges with every refusal replaces it with each
        request that was in flight): the newest is answered, once (`_AUTH_ANSWERS`).

        Raises:
            _AuthFailed: no (new) challenge, no OK, a dropped connection, or the relay said no.
        """
        async with conn.auth_lock:
            if conn.auth_generation != seen_generation and conn.authenticated:
                return
            if conn.refused is not None and conn.challenge == conn.answered:
                raise _AuthFailed(f"AUTH refused: {conn.refused}", refused=True)
            conn.authenticated = False
            for answer in range(1, _AUTH_ANSWERS + 1):
                challenge, ok = await self._answer_challenge(conn)
                if ok.accepted:
                    conn.authenticated = True
                    conn.auth_generation += 1
                    self._lines.record("relay_authenticated", conn.agent, agent=conn.agent)
                    return
                superseded = conn.challenge != challenge
                if superseded and answer < _AUTH_ANSWERS:
                    self._lines.record("relay_auth_superseded", conn.agent, agent=conn.agent)
                    continue
                # The relay's text, cut where it enters (`quote_reason`): it is kept on
                # the connection, logged, and the reason of every request it fails.
                refusal = quote_reason(ok.message)
                self._lines.record("relay_auth_refused", conn.agent, agent=conn.agent,
                                   reason=refusal)
                if not superseded:
                    conn.refused = refusal
                self._retire(conn)
                raise _AuthFailed(f"AUTH refused: {refusal}", refused=True)
            raise AssertionError("unreachable: the last answer returns or raises")  # pragma: no cover

    async def _answer_challenge(self, conn: _Connection) -> tuple[str, Ok]:
        """Send one AUTH for the newest challenge not answered yet (waiting up to
        ``timeouts.ok`` for one); that challenge and the relay's OK to it.

        Raises:
            _AuthFailed: no (new) challenge, not signed, no OK, a dropped connection.
        """
        with trio.move_on_after(self._timeouts.ok):
            while conn.alive and conn.challenge in (None, conn.answered):
                await conn.challenge_seen.wait()
        if not conn.alive:
            raise _AuthFailed("connection dropped before AUTH", refused=False)
        challenge = conn.challenge
        if challenge is None:
            raise _AuthFailed("the relay sent no AUTH challenge", refused=False)
        if challenge == conn.answered:
            raise _AuthFailed("the relay sent no new AUTH challenge", refused=False)
        try:
            auth_event = await self._auth_signer(
                conn.agent, self._url.text, challenge, int(time.time()))
            frame = encode_auth(auth_event)
        except AuthNotSigned as exc:
            raise _AuthFailed(f"AUTH not signed: {exc.reason}", refused=False) from None
        except ValueError as exc:  # not a kind-22242 event: our signer's bug
            raise _AuthFailed(f"AUTH event unusable: {type(exc).__name__}", refused=False) from None
        event_id = auth_event.id
        waiter = conn.expect_ok(event_id)
        # Spent once part of the frame may reach the relay (`out.started`).
        previous, conn.answered, conn.auth_pending = conn.answered, challenge, event_id
        out = _Frame(frame)
        try:
            # The write counts in the OK's timeout (as an EVENT's, `_publish_on`).
            with trio.move_on_after(self._timeouts.ok):
                try:
                    await conn.send(out)
                except (trio_websocket.ConnectionClosed, trio.BrokenResourceError):
                    why = "dropped while sending" if out.started else "closed before sending"
                    raise _AuthFailed(f"connection {why} AUTH", refused=False) from None
                await waiter.done.wait()
        finally:
            conn.forget_ok(event_id, waiter)
            conn.auth_pending = None
            if not out.started:
                conn.answered = previous
        if not out.written:
            raise _AuthFailed(
                f"AUTH not written within {self._timeouts.ok}s: connection closed" if out.started
                else f"AUTH not sent within {self._timeouts.ok}s: {_BUSY}", refused=False)
        if waiter.ok is None:
            why = "connection dropped" if waiter.dropped else f"no OK within {self._timeouts.ok}s"
            raise _AuthFailed(f"AUTH unanswered: {why}", refused=False)
        return challenge, waiter.ok

    async def _auth_if_challenged(self, conn: _Connection) -> None:
        # A challenge sent at connect (Buzz) is answered before we send anything, which
        # saves the refused round trip. One answered already is not answered again; one
        # refused is the refusal again (`_authenticate`).
        if conn.challenge is not None and not conn.authenticated and (
                conn.challenge != conn.answered or conn.refused is not None):
            await self._authenticate(conn, conn.auth_generation)

    # publishing -------------------------------------------------------------------------

    async def publish(self, agent: str, event: SignedEvent) -> PublishResult:
        """Send one signed event as `agent` and report what the relay did with it.

        Args:
            agent: the pubkey whose connection (and AUTH) carries the event.
            event: the signed event, sent exactly as given (a retry sends the same bytes).

        Returns:
            Accepted | Rejected | NotSent | Unknown (see the module docstring's mapping).

        Raises:
            TypeError: `event` is not a SignedEvent (our bug). RuntimeError: pool not running.
            Whatever the AUTH signer raises other than AuthNotSigned (`AuthNotSigned`).
        """
        if not isinstance(event, SignedEvent):
            raise TypeError("publish needs a SignedEvent")
        event_id = event.id
        frame = encode_event(event)
        started = time.monotonic()
        result: PublishResult
        ok_seconds = self._timeouts.ok
        try:
            async with self._use(agent) as conn, conn.write_gate.passage(ok_seconds) as through:
                if through:
                    result = await self._publish_on(conn, event_id, frame)
                else:
                    result = NotSent(reason=f"{_GATE_WAIT}: not sent within {ok_seconds}s")
        except _Unreachable as exc:
            result = NotSent(reason=exc.reason)
        if self.watermarks is not None and isinstance(result, (Accepted, Unknown)) \
                and is_replaceable(event.kind):
            # A version the relay took, or may have (an Unknown is retried with these
            # bytes), is one this host must never build below. A signed event that never
            # left, or that the relay refused, is not: it cannot be the relay's newest.
            # The write commits with an fsync and may wait out the busy timeout behind
            # another writer: a worker thread's, never the loop's. Awaited, so the next
            # merge of this record (serialized per agent) sees it.
            try:
                await trio.to_thread.run_sync(
                    self.watermarks.record, event.pubkey, event.kind,
                    event.tag_value("d") or "", event.created_at, event.id)
            except (sqlite3.Error, OSError) as exc:
                # The relay's verdict stands: the event landed (or may have) whatever
                # this disk did. A lost write only leaves the floor one version low (it
                # never moves back), so a relay withholding exactly this version could
                # have the one before merged, as before the guard existed
                # (daemon/state/sign_watermarks.py). One line a minute per cause.
                self._watermark_faults.record(
                    (type(exc).__name__,), agent=event.pubkey, kind=event.kind,
                    event_id=event.id, error=type(exc).__name__,
                    sqlite_error=getattr(exc, "sqlite_errorname", None))
        self._observe("publish", type(result).__name__.lower(), started)
        return result

    async def _publish_on(self, conn: _Connection, event_id: str, frame: str) -> PublishResult:
        refused_first: str | None = None
        for _attempt in range(2):
            try:
                await self._auth_if_challenged(conn)
            except _AuthFailed as exc:
                if refused_first is not None:
                    return Rejected(reason=f"{refused_first} ({exc.reason})")
                return NotSent(reason=exc.reason)
            generation = conn.auth_generation
            if not conn.alive:
                if refused_first is not None:
                    return Rejected(reason=f"{refused_first} (connection dropped before resending)")
                return NotSent(reason="connection closed before sending")
            waiter = conn.expect_ok(event_id)
            out = _Frame(frame)
            dropped = False
            try:
                # The write counts in the OK's timeout: a relay that stopped reading
                # holds the write itself, and nothing else would end it.
                with trio.move_on_after(self._timeouts.ok):
                    try:
                        await conn.send(out)
                    except (trio_websocket.ConnectionClosed, trio.BrokenResourceError):
                        dropped = True
                    else:
                        await waiter.done.wait()
            finally:
                conn.forget_ok(event_id, waiter)
            if not out.written:
                if out.started:
                    # Part of the frame may have left: the relay might have it.
                    return Unknown(reason="connection dropped while sending" if dropped else
                                   f"EVENT not written within {self._timeouts.ok}s: "
                                   "connection closed")
                why = ("connection closed before sending" if dropped else
                       f"not sent within {self._timeouts.ok}s: {_BUSY}")
                if refused_first is not None:
                    return Rejected(reason=f"{refused_first} ({why})")
                return NotSent(reason=why)
            ok = waiter.ok
            if ok is None:
                if waiter.dropped:
                    return Unknown(reason="connection dropped before OK")
                return Unknown(reason=f"no OK within {self._timeouts.ok}s")
            if ok.accepted:
                return Accepted(duplicate=ok.prefix is Prefix.DUPLICATE, message=ok.message)
            if ok.prefix is Prefix.AUTH_REQUIRED and refused_first is None:
                refused_first = ok.message
                try:
                    await self._authenticate(conn, generation)
                except _AuthFailed as exc:
                    return Rejected(reason=f"{ok.message} ({exc.reason})")
                continue
            return Rejected(reason=ok.message)
        raise AssertionError("unreachable: the second attempt always returns")  # pragma: no cover

    # reading ----------------------------------------------------------------------------

    async def query(self, agent: str, filters: Sequence[Mapping[str, object]]
                    ) -> list[dict[str, object]]:
        """Stored events matching `filters`, read as `agent`, until EOSE.

        Returns:
            The events in the order the relay sent them, each the dict it sent.

        Raises:
            RelayUnavailable: unreachable, dropped, no EOSE in time, protocol broken.
            RelayRefused: CLOSED (``restricted:`` or a second ``auth-required:``), AUTH refused.
            ValueError: no filters, or a filter that is not a mapping (our bug).
            RuntimeError: the pool is not running.
            Whatever the AUTH signer raises other than AuthNotSigned (`AuthNotSigned`).
        """
        if not filters or not all(isinstance(f, Mapping) for f in filters):
            raise ValueError("query needs at least one filter, each a mapping")
        started = time.monotonic()
        outcome = "unavailable"
        try:
            async with self._use(agent) as conn, \
                    conn.read_gate.passage(self._timeouts.eose) as through:
                if not through:
                    raise RelayUnavailable(f"{_GATE_WAIT}: no EOSE within {self._timeouts.eose}s")
                events = await self._query_on(conn, filters)
                outcome = "ok"
                return events
        except _Unreachable as exc:
            raise RelayUnavailable(exc.reason) from None
        except RelayRefused:
            outcome = "refused"
            raise
        finally:
            self._observe("query", outcome, started)

    def _observe(self, op: str, result: str, started: float) -> None:
        if self._observer is not None:
            self._observer(op, result, time.monotonic() - started)

    async def _query_on(
        self, conn: _Connection, filters: Sequence[Mapping[str, object]]
    ) -> list[dict[str, object]]:
        for attempt in range(2):
            generation = await self._auth_for_req(conn)
            sub_id, sub = conn.open_subscription()
            req = _Frame(encode_req(sub_id, filters))
            try:
                await self._req_until_eose(conn, req, sub.done)
            finally:
                await self._close_subscription(conn, sub_id, req)
                # Bytes of an answer are held until its caller drops it (_results); every
                # other way out of here gives them back now.
                events, held = sub.hand_over()
                if not sub.complete:
                    self._budget.give_back(held)
            if sub.dropped:
                raise RelayUnavailable("connection dropped before EOSE")
            if sub.overflow == "query":
                raise AnswerTooLarge(
                    f"relay sent more than {MAX_EVENTS_PER_QUERY} events or "
                    f"{MAX_QUERY_BYTES} decoded bytes for one query"
                )
            if sub.overflow == "pool":
                self._lines.record("relay_result_budget_full", conn.agent, agent=conn.agent,
                                   held=self._budget.used, total=self._budget.total)
                raise RelayUnavailable(
                    f"the relay results held exceed max_result_bytes ({self._budget.total})"
                )
            if sub.closed is None:
                results = _Results(events)
                weakref.finalize(results, self._budget.give_back, held)
                return results
            await self._after_closed(conn, sub_id, sub.closed, generation, attempt)
        raise AssertionError("unreachable: the second attempt always returns")  # pragma: no cover

    async def _auth_for_req(self, conn: _Connection) -> int:
        """Authenticate first if challenged; the AUTH generation the REQ goes out under."""
        try:
            await self._auth_if_challenged(conn)
        except _AuthFailed as exc:
            raise (RelayRefused if exc.refused else RelayUnavailable)(exc.reason) from None
        return conn.auth_generation

    async def _req_until_eose(self, conn: _Connection, req: _Frame, done: trio.Event) -> None:
        """Send the REQ and wait for EOSE, CLOSED or a drop (`done`), at most timeouts.eose
        for both (the write counts, as an EVENT's does in `_publish_on`)."""
        with trio.move_on_after(self._timeouts.eose):
            try:
                await conn.send(req)
            except (trio_websocket.ConnectionClosed, trio.BrokenResourceError):
                why = "dropped while sending" if req.started else "closed before sending"
                raise RelayUnavailable(f"connection {why} REQ") from None
            await done.wait()
        if not req.written:
            raise RelayUnavailable(
                f"REQ not written within {self._timeouts.eose}s: connection closed" if req.started
                else f"REQ not sent within {self._timeouts.eose}s: {_BUSY}")
        if not done.is_set():
            raise RelayUnavailable(f"no EOSE within {self._timeouts.eose}s")

    async def _after_closed(self, conn: _Connection, sub_id: str, message: str,
                            generation: int, attempt: int) -> None:
        """A REQ was CLOSED: authenticate for the one retry a first `auth-required:`
        earns (then return), or raise RelayRefused / RelayUnavailable. `message` was cut
        when it arrived (`_Connection.dispatch`)."""
        closed = Closed(subscription_id=sub_id, message=message)
        if closed.prefix is Prefix.AUTH_REQUIRED and attempt == 0:
            try:
                await self._authenticate(conn, generation)
            except _AuthFailed as exc:
                raise (RelayRefused if exc.refused else RelayUnavailable)(
                    f"{closed.message} ({exc.reason})"
                ) from None
            return
        raise RelayRefused(closed.message)

    async def _close_subscription(self, conn: _Connection, sub_id: str,
                                  req: _Frame | None = None) -> None:
        # NIP-01: always CLOSE, also after CLOSED/timeout/cancel; bounded and shielded so a
        # cancelled caller still frees the relay's subscription slot. Not for a REQ
        # (`req`) of which nothing left: the relay has no such subscription.
        conn.subscriptions.pop(sub_id, None)
        if not conn.alive or (req is not None and not req.started):
            return
        with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_SECONDS):
            try:
                await conn.send(_Frame(encode_close(sub_id)))
            except (trio_websocket.ConnectionClosed, trio.BrokenResourceError):
                pass

    # live subscriptions ---------------------------------------------------------------

    async def subscribe(self, agent: str, filters: Sequence[Mapping[str, object]],
                        sink: LiveSink) -> LiveSubscription:
        """Open a subscription as `agent` and keep it open past EOSE, feeding `sink`.

        Returns once the relay sent EOSE (the stored events went to `sink` with
        ``live=False``); from then on every event goes to `sink` with ``live=True`` until
        `LiveSubscription.close`, or until the relay's CLOSED or a dropped connection
        (`sink.ended`). An open live subscription keeps its connection from idle close.

        Raises:
            SubscriptionsFull: the agent's connection holds max_live_subscriptions already.
            RelayUnavailable / RelayRefused: as `query`.
            ValueError, RuntimeError, the AUTH signer's own faults: as `query`.
        """
        if not filters or not all(isinstance(f, Mapping) for f in filters):
            raise ValueError("subscribe needs at least one filter, each a mapping")
        try:
            async with self._use(agent) as conn, \
                    conn.read_gate.passage(self._timeouts.eose) as through:
                if not through:
                    raise RelayUnavailable(f"{_GATE_WAIT}: no EOSE within {self._timeouts.eose}s")
                if conn.live >= self._max_live:
                    raise SubscriptionsFull(
                        f"{conn.live} live subscriptions on this connection already")
                # Counted from here, not from EOSE: an agent's polls of several channels
                # arrive together, and each would pass the check before any is counted.
                conn.live += 1
                established = False
                try:
                    for attempt in range(2):
                        generation = await self._auth_for_req(conn)
                        sub_id, live = conn.open_live(sink)
                        req = _Frame(encode_req(sub_id, filters))
                        try:
                            await self._req_until_eose(conn, req, live.done)
                            if live.dropped:
                                raise RelayUnavailable("connection dropped before EOSE")
                            if live.closed is None:
                                established = True
                                conn.in_use += 1
                                return LiveSubscription(self, conn, sub_id)
                        finally:
                            if not established:
                                await self._close_subscription(conn, sub_id, req)
                        assert live.closed is not None
                        await self._after_closed(conn, sub_id, live.closed, generation, attempt)
                finally:
                    if not established:
                        conn.live -= 1
        except _Unreachable as exc:
            raise RelayUnavailable(exc.reason) from None
        raise AssertionError("unreachable: the second attempt always returns")  # pragma: no cover

    def _end_live(self, conn: _Connection, sub_id: str) -> None:
        """Forget a live subscription now; CLOSE it on the relay soon (pool's nursery)."""
        if conn.subscriptions.pop(sub_id, None) is None:
            return
        conn.live -= 1
        conn.in_use -= 1
        conn.last_used = trio.current_time()
        self._close_if_retired(conn)
        if conn.alive and self._nursery is not None:
            self._nursery.start_soon(self._close_subscription, conn, sub_id)


class LiveSubscription:
    """An open live subscription (`RelayPool.subscribe`); `close` ends it, idempotently."""

    __slots__ = ("_pool", "_conn", "_sub_id", "_open")

    def __init__(self, pool: RelayPool, conn: _Connection, sub_id: str) -> None:
        self._pool, self._conn, self._sub_id = pool, conn, sub_id
        self._open = True

    def close(self) -> None:
        """Stop feeding the sink at once; the relay gets CLOSE (best effort, bounded).
        Synchronous, so that a cache evicting a window never waits on the network."""
        if self._open:
            self._open = False
            self._pool._end_live(self._conn, self._sub_id)
