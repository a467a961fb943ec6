"""NULL RELAY — a benchmark relay that costs (almost) nothing, so the daemon's own cost shows.

    python benchmarks/null_relay.py --port N [--events FILE]

It is a real WebSocket server (trio-websocket) on 127.0.0.1 that speaks just enough NIP-01
and NIP-42 for the broker:

- on connect it sends ``["AUTH", <random challenge>]`` (as Buzz's relay does), and answers
  every ``AUTH`` with ``OK true`` — it checks nothing, so no relay-side signature check is
  in the figures;
- every ``EVENT`` is answered ``["OK", id, true, ""]`` at once; nothing is stored;
- every ``REQ`` is answered with the canned events of ``--events`` (a JSON array, newest
  first, pre-signed by the benchmark) that match the filters, then ``EOSE``. Filter
  members understood: ids, kinds, authors, since, until, limit, ``#<letter>`` — what the
  read path sends (daemon/relay/paging.py), so paging behaves exactly as against a real relay.
  Without ``--events`` every REQ gets EOSE alone;
- ``CLOSE`` is ignored (there is no live subscription to close).

TCP_NODELAY is set on every accepted socket (trio sets it; we set it again explicitly):
without it a multi-frame answer (EVENTs then EOSE) waits for the client's delayed ACK.

It prints exactly one line, its ``ws://`` URL, once it listens, and runs until SIGTERM or
SIGINT. It binds loopback only. Not a relay for anything but benchmarks: it accepts any
AUTH and any event.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import trio
import trio_websocket

#: The challenge length Buzz's relay uses is unspecified; 32 hex characters is ample.
CHALLENGE_BYTES = 16
#: Largest frame accepted; the daemon's events are far smaller.
MAX_MESSAGE_BYTES = 1 << 20


def _tag_values(event: Mapping[str, Any], letter: str) -> set[str]:
    return {t[1] for t in event.get("tags", ()) if len(t) >= 2 and t[0] == letter}


def matches(event: Mapping[str, Any], flt: Mapping[str, Any]) -> bool:
    """NIP-01 filter semantics for the members the broker sends (limit applied by the caller)."""
    for name, wanted in flt.items():
        if name == "limit":
            continue
        if name == "ids" and event["id"] not in wanted:
            return False
        if name == "kinds" and event["kind"] not in wanted:
            return False
        if name == "authors" and event["pubkey"] not in wanted:
            return False
        if name == "since" and event["created_at"] < wanted:
            return False
        if name == "until" and event["created_at"] > wanted:
            return False
        if name.startswith("#") and not (_tag_values(event, name[1:]) & set(wanted)):
            return False
    return True


def answer_req(events: Sequence[Mapping[str, Any]], filters: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The union over filters, each cut at its own limit, newest first, no duplicates."""
    seen: dict[str, Mapping[str, Any]] = {}
    for flt in filters:
        limit = flt.get("limit")
        taken = 0
        for event in events:  # already newest first
            if limit is not None and taken >= limit:
                break
            if matches(event, flt):
                taken += 1
                seen.setdefault(event["id"], event)
    return sorted(seen.values(), key=lambda e: (-e["created_at"], e["id"]))


class Answers:
    """REQ answers, each event serialized once and each distinct filter list matched once:
    the relay must cost far less than the daemon it measures."""

    def __init__(self, canned: list[dict[str, Any]]) -> None:
        self.canned = canned
        self.cache: dict[str, list[str]] = {}

    def frames(self, sub: str, filters: Sequence[Mapping[str, Any]]) -> list[str]:
        key = json.dumps(filters, sort_keys=True)
        bodies = self.cache.get(key)
        if bodies is None:
            bodies = [json.dumps(e) for e in answer_req(self.canned, filters)] if self.canned else []
            if len(self.cache) > 4096:
                self.cache.clear()
            self.cache[key] = bodies
        prefix = '["EVENT",' + json.dumps(sub) + ","
        return [prefix + b + "]" for b in bodies]


async def _connection(request: trio_websocket.WebSocketRequest, answers: Answers) -> None:
    ws = await request.accept()
    stream = ws._stream  # the accepted trio.SocketStream; only to set a socket option
    sock = getattr(stream, "socket", None)
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await ws.send_message(json.dumps(["AUTH", secrets.token_hex(CHALLENGE_BYTES)]))
        while True:
            message = json.loads(await ws.get_message())
            verb = message[0]
            if verb == "EVENT" or verb == "AUTH":
                await ws.send_message(json.dumps(["OK", message[1]["id"], True, ""]))
            elif verb == "REQ":
                sub = message[1]
                for frame in answers.frames(sub, message[2:]):
                    await ws.send_message(frame)
                await ws.send_message(json.dumps(["EOSE", sub]))
    except (trio_websocket.ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
        return
    except (ValueError, IndexError, KeyError, TypeError):
        await ws.aclose(code=1003, reason="not a NIP-01 message")


async def _serve(port: int, canned: list[dict[str, Any]]) -> None:
    answers = Answers(canned)
    async with trio.open_nursery() as nursery:
        async def handler(request: trio_websocket.WebSocketRequest) -> None:
            await _connection(request, answers)

        await nursery.start(
            lambda task_status: trio_websocket.serve_websocket(
                handler, "127.0.0.1", port, ssl_context=None,
                max_message_size=MAX_MESSAGE_BYTES, task_status=task_status,
            )
        )
        print(f"ws://127.0.0.1:{port}", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="loopback TCP port (1..65535)")
    parser.add_argument("--events", help="JSON array of signed events to answer REQs with")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        print("null_relay: --port must be 1..65535", file=sys.stderr)
        return 2
    canned: list[dict[str, Any]] = []
    if args.events:
        with open(args.events, encoding="utf-8") as fh:
            canned = sorted(json.load(fh), key=lambda e: (-e["created_at"], e["id"]))
    try:
        trio.run(_serve, args.port, canned)
    except OSError as exc:
        print(f"null_relay: cannot listen on 127.0.0.1:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
