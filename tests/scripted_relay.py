"""A scripted relay for fault tests: a tiny NIP-01/NIP-42 relay whose answers follow a Script.

It speaks just enough of NIP-01 to drive the broker's relay client into every fault the
spec names: OK true / false / ``duplicate:``, no OK at all, a connection dropped right
after an EVENT, CLOSED ``auth-required:`` / ``restricted:``, a REQ that never sees EOSE,
and AUTH either at connect or only after a refusal; AUTH for everything, for writes only
(``auth_for``), or for some kinds only (``protected_kinds``), with one challenge per
connection or a new one with every refusal (``challenge_every_refusal``). It stores accepted events in memory
and answers a REQ with every stored event (filters are not interpreted: the fault tests
only need "what was stored comes back").

What it says when it refuses can be scripted per answer (``restricted_reason``,
``auth_refusal``): a hostile relay's message may fill a whole frame, and be new every time.

It checks AUTH events for real (kind 22242, id, BIP-340 signature, ``challenge`` tag, and
a ``relay`` tag equal to ``expected_relay_tag``, which is the URL it serves unless the
script says otherwise), because a client that signs a wrong AUTH must fail here as it
would on Buzz. Everything it receives is recorded in ``received`` (per connection) so a
test can assert what the client sent (e.g. that CLOSE always follows a REQ).

Not a relay for anything but tests: no persistence, no filters, no limits.
"""

from __future__ import annotations

import enum
import hashlib
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import coincurve
import trio
import trio_websocket


def _not_a_member(_n: int) -> str:
    return "restricted: not a member"


def _bad_auth(_n: int) -> str:
    return "auth-required: bad AUTH"


class EventReply(enum.Enum):
    """What the relay does with one EVENT."""

    ACCEPT = "accept"  #: store it; OK true "" (or duplicate: if already stored)
    DUPLICATE = "duplicate"  #: OK true "duplicate: ..." whether or not stored
    REJECT = "reject"  #: OK false with Script.reject_reason
    SILENT = "silent"  #: no OK at all
    LOST_OK = "lost_ok"  #: store it, and no OK (the answer lost on its way back)
    DROP = "drop"  #: close the TCP connection at once, no OK


class ReqReply(enum.Enum):
    """What the relay does with one REQ."""

    EOSE = "eose"  #: every stored event, then EOSE
    NEVER_EOSE = "never_eose"  #: every stored event, and then nothing
    RESTRICTED = "restricted"  #: CLOSED "restricted: ..."
    DROP = "drop"  #: close the connection


@dataclass(frozen=True, slots=True, kw_only=True)
class Script:
    """The relay's behaviour. ``events``/``reqs`` are consumed one per message across
    the relay's life; when exhausted, ``default_event``/``default_req`` apply."""

    challenge_at_connect: bool = False
    require_auth: bool = False
    accept_auth: bool = True
    events: tuple[EventReply, ...] = ()
    default_event: EventReply = EventReply.ACCEPT
    reqs: tuple[ReqReply, ...] = ()
    default_req: ReqReply = ReqReply.EOSE
    reject_reason: str = "invalid: scripted refusal"
    #: Buzz's reaction rule (ingest.rs): a kind 7 whose (author, target `e`, content) is
    #: already active is refused `OK false "duplicate: reaction already exists"`, also when
    #: it is the very event stored (Buzz's reactions upsert runs before its event insert).
    buzz_reactions: bool = False
    expected_relay_tag: str | None = None
    #: The verbs `require_auth` covers: ``{"EVENT"}`` is a relay that lets anyone read
    #: and only authenticated pubkeys write.
    auth_for: frozenset[str] = frozenset({"EVENT", "REQ"})
    #: Kinds that need AUTH whatever `require_auth` says: an EVENT of one, or a REQ
    #: whose filters name one (a relay guarding DMs or protected events this way).
    protected_kinds: frozenset[int] = frozenset()
    #: A new challenge with every refusal, and only the newest is valid (NIP-42: "valid
    #: ... until another challenge is sent by the relay"). False: one per connection.
    challenge_every_refusal: bool = False
    #: Each EVENT or REQ answered under AUTH spends it: the next needs a new AUTH, to a
    #: new challenge (a hostile relay making every request cost a signature and a log).
    auth_spent_by_each_request: bool = False
    #: Frames sent as they are the moment a connection is accepted, before anything else
    #: (a hostile relay's unsolicited answers: OKs and EOSEs for nothing we sent).
    greeting: tuple[str, ...] = ()
    #: The message of the relay's n-th ``restricted:`` CLOSED (n counts from 1 over the
    #: relay's life), sent as it is (``ensure_ascii=False``: escaped, non-ASCII text would
    #: grow up to 6x, past the client's frame cap).
    restricted_reason: Callable[[int], str] = _not_a_member
    #: The message of the relay's n-th refused AUTH (OK false), sent as it is.
    auth_refusal: Callable[[int], str] = _bad_auth


def _event_id(ev: dict[str, Any]) -> str:
    serial = json.dumps(
        [0, ev["pubkey"], ev["created_at"], ev["kind"], ev["tags"], ev["content"]],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(serial.encode("utf-8")).hexdigest()


def verify_event(ev: dict[str, Any]) -> bool:
    """NIP-01 id and BIP-340 signature, with coincurve (independent of custody)."""
    try:
        if _event_id(ev) != ev["id"]:
            return False
        pub = coincurve.PublicKeyXOnly(bytes.fromhex(ev["pubkey"]))
        return bool(pub.verify(bytes.fromhex(ev["sig"]), bytes.fromhex(ev["id"])))
    except (KeyError, ValueError, TypeError):
        return False


@dataclass
class ConnectionLog:
    """What one client connection sent, and which pubkeys it authenticated as."""

    received: list[list[Any]] = field(default_factory=list)
    authed: set[str] = field(default_factory=set)


class ScriptedRelay:
    """Run with ``await nursery.start(relay.serve, port)``; ``url`` is set once started."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.url = ""
        self.stored: dict[str, dict[str, Any]] = {}
        self.connections: list[ConnectionLog] = []
        self._events = list(script.events)
        self._reqs = list(script.reqs)
        #: How many ``restricted:`` CLOSEDs and AUTH refusals the relay sent.
        self.restricted_sent = 0
        self.auth_refused = 0
        #: (connection, subscription id) of every REQ answered with EOSE and not CLOSEd
        self.open_reqs: list[tuple[trio_websocket.WebSocketConnection, str]] = []

    async def close_open_reqs(self, reason: str = "restricted: no longer a member") -> int:
        """Send CLOSED for every subscription still open, as a relay does when it ends
        one itself (a member removed); returns how many."""
        reqs, self.open_reqs = self.open_reqs, []
        for ws, sub_id in reqs:
            await ws.send_message(json.dumps(["CLOSED", sub_id, reason]))
        return len(reqs)

    async def push(self, event: dict[str, Any]) -> int:
        """Send `event` to every subscription still open, as a live event (whatever the
        filters: a hostile relay's choice); returns to how many."""
        for ws, sub_id in self.open_reqs:
            await ws.send_message(json.dumps(["EVENT", sub_id, event]))
        return len(self.open_reqs)

    def _reaction_active(self, ev: dict[str, Any]) -> bool:
        """A kind 7 of this author, target and content is stored (`Script.buzz_reactions`)."""
        def key(e: dict[str, Any]) -> tuple[object, ...]:
            target = next((t[1] for t in e.get("tags", []) if len(t) >= 2 and t[0] == "e"), None)
            return e.get("pubkey"), target, e.get("content")
        return ev.get("kind") == 7 and any(
            e.get("kind") == 7 and key(e) == key(ev) for e in self.stored.values())

    def _next_event(self) -> EventReply:
        return self._events.pop(0) if self._events else self.script.default_event

    def _next_req(self) -> ReqReply:
        return self._reqs.pop(0) if self._reqs else self.script.default_req

    @property
    def received(self) -> list[list[Any]]:
        """Every message from every connection, in connection order."""
        return [m for c in self.connections for m in c.received]

    async def serve(
        self, port: int, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on 127.0.0.1:`port` until cancelled; started once listening."""
        self.url = f"ws://127.0.0.1:{port}"
        await trio_websocket.serve_websocket(
            self._handle, "127.0.0.1", port, None, task_status=task_status
        )

    async def _handle(self, request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        log = ConnectionLog()
        self.connections.append(log)
        challenge = secrets.token_hex(16)
        challenge_sent = False
        for frame in self.script.greeting:
            await ws.send_message(frame)
        if self.script.challenge_at_connect:
            await ws.send_message(json.dumps(["AUTH", challenge]))
            challenge_sent = True

        async def refuse_unauthenticated(*frame: object) -> None:
            # NIP-42: challenge (once per connection, or anew with every refusal) if not
            # done yet, then refuse with `auth-required:` — an OK false for an EVENT, a
            # CLOSED for a REQ.
            nonlocal challenge_sent, challenge
            if challenge_sent and self.script.challenge_every_refusal:
                challenge, challenge_sent = secrets.token_hex(16), False
            if not challenge_sent:
                await ws.send_message(json.dumps(["AUTH", challenge]))
                challenge_sent = True
            await ws.send_message(json.dumps([*frame, "auth-required: authenticate first"]))

        def spend_auth() -> None:
            nonlocal challenge_sent, challenge
            if self.script.auth_spent_by_each_request and log.authed:
                log.authed.clear()
                challenge, challenge_sent = secrets.token_hex(16), False

        def needs_auth(msg: list[Any]) -> bool:
            if log.authed:
                return False
            if self.script.require_auth and msg[0] in self.script.auth_for:
                return True
            if msg[0] == "EVENT":
                named = {msg[1].get("kind")}
            else:
                named = {k for f in msg[2:] if isinstance(f, dict) for k in f.get("kinds", [])}
            return not named.isdisjoint(self.script.protected_kinds)

        try:
            while True:
                msg = json.loads(await ws.get_message())
                log.received.append(msg)
                verb = msg[0]
                if verb == "AUTH":
                    ev = msg[1]
                    tags = {t[0]: t[1] for t in ev.get("tags", []) if len(t) >= 2}
                    relay_tag = self.script.expected_relay_tag or self.url
                    ok = (
                        self.script.accept_auth
                        and ev.get("kind") == 22242
                        and verify_event(ev)
                        and challenge_sent
                        and tags.get("challenge") == challenge
                        and tags.get("relay") == relay_tag
                    )
                    if ok:
                        log.authed.add(ev["pubkey"])
                        await ws.send_message(json.dumps(["OK", ev["id"], True, ""]))
                    else:
                        self.auth_refused += 1
                        await ws.send_message(json.dumps(
                            ["OK", ev["id"], False, self.script.auth_refusal(self.auth_refused)],
                            ensure_ascii=False))
                elif verb == "EVENT":
                    ev = msg[1]
                    if needs_auth(msg):
                        await refuse_unauthenticated("OK", ev["id"], False)
                        continue
                    spend_auth()
                    reply = self._next_event()
                    if reply is EventReply.DROP:
                        return
                    if reply is EventReply.SILENT:
                        continue
                    if reply is EventReply.REJECT:
                        answer = ["OK", ev["id"], False, self.script.reject_reason]
                    elif self.script.buzz_reactions and self._reaction_active(ev):
                        answer = ["OK", ev["id"], False, "duplicate: reaction already exists"]
                    elif reply is EventReply.LOST_OK:
                        self.stored[ev["id"]] = ev
                        continue
                    elif reply is EventReply.DUPLICATE or ev["id"] in self.stored:
                        answer = ["OK", ev["id"], True, "duplicate: already have this event"]
                    else:
                        self.stored[ev["id"]] = ev
                        answer = ["OK", ev["id"], True, ""]
                    await ws.send_message(json.dumps(answer))
                elif verb == "REQ":
                    sub_id = msg[1]
                    if needs_auth(msg):
                        await refuse_unauthenticated("CLOSED", sub_id)
                        continue
                    spend_auth()
                    req = self._next_req()
                    if req is ReqReply.DROP:
                        return
                    if req is ReqReply.RESTRICTED:
                        self.restricted_sent += 1
                        reason = self.script.restricted_reason(self.restricted_sent)
                        await ws.send_message(
                            json.dumps(["CLOSED", sub_id, reason], ensure_ascii=False))
                        continue
                    for ev in list(self.stored.values()):
                        await ws.send_message(json.dumps(["EVENT", sub_id, ev]))
                    if req is ReqReply.EOSE:
                        await ws.send_message(json.dumps(["EOSE", sub_id]))
                        self.open_reqs.append((ws, sub_id))
                elif verb == "CLOSE":
                    self.open_reqs = [r for r in self.open_reqs if r != (ws, msg[1])]
                # Anything else: recorded, no answer.
        except trio_websocket.ConnectionClosed:
            return
        finally:
            # DROP: end the TCP connection without a close handshake.
            await trio.aclose_forcefully(ws._stream)
