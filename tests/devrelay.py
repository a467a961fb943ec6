"""DEVELOPMENT RELAY — nostr-sdk's LocalRelay, for tests and `make run`. Never production.

    python -m tests.devrelay --host 127.0.0.1 --port N [--auth]

Starts rust-nostr's LocalRelay (a real NIP-01 relay, in memory) on the given loopback
address, prints exactly one line, its ``ws://`` URL, once it accepts connections, and runs
until SIGTERM or SIGINT. ``--auth`` makes NIP-42 AUTH mandatory for both reading and
writing, as Buzz's relay does; ``--auth-writes`` for writing only (reads pass without it,
as on many public relays). Port 0 is refused: LocalRelay reports 0 back instead of the
port it bound, so the caller picks a free port itself (`tests.fixtures.relay.free_port`).

Settings, and why:
- the rate limit is raised far above anything a test sends: the default would throttle
  the paging tests (1,000 events) and the benchmarks;
- ``max_filter_limit`` is 500, like Buzz's relay, so a REQ cannot return more than 500
  events per filter here either (the cursor design depends on that cap).

It is asyncio (nostr-sdk's bindings are) while our code is trio, which is one reason it
runs in its own process; the other is that a test can kill it to simulate a dead relay.

Known trap (design.md): LocalRelay does not set TCP_NODELAY on accepted sockets, so a
multi-frame reply can wait ~40 ms for the client's delayed ACK. Do not assert tight
latencies against this relay.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import nostr_sdk

#: Buzz's relay answers at most 500 results per filter (spec "Relay connection").
MAX_FILTER_LIMIT = 500
#: Far above what any test or benchmark sends: we measure our code, not a throttle.
MAX_REQS_PER_MINUTE = 1_000_000
NOTES_PER_MINUTE = 100_000_000


#: ``--auth``: AUTH to read and write (Buzz); ``--auth-writes``: to write only, reads open.
_AUTH_MODES = {"both": nostr_sdk.LocalRelayBuilderNip42Mode.BOTH,
               "writes": nostr_sdk.LocalRelayBuilderNip42Mode.WRITE}


def _build(host: str, port: int, auth: str | None) -> nostr_sdk.LocalRelay:
    builder = (
        nostr_sdk.LocalRelayBuilder()
        .addr(host)
        .port(port)
        .max_filter_limit(MAX_FILTER_LIMIT)
        .rate_limit(
            nostr_sdk.RateLimit(max_reqs=MAX_REQS_PER_MINUTE, notes_per_minute=NOTES_PER_MINUTE)
        )
    )
    if auth is not None:
        builder = builder.nip42(nostr_sdk.LocalRelayBuilderNip42(mode=_AUTH_MODES[auth]))
    # `LocalRelay.run(builder)` as a static call crashes the process in 0.45: build, then run.
    return builder.build()


async def _serve(host: str, port: int, auth: str | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    relay = _build(host, port, auth)
    await relay.run()
    url = str(await relay.url())
    # The one line the parent waits for; flush so a pipe reader sees it now.
    print(url, flush=True)
    await stop.wait()
    relay.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.devrelay",
        description="DEVELOPMENT relay (nostr-sdk LocalRelay) for tests and `make run`.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--auth", dest="auth", action="store_const", const="both",
                       help="require NIP-42 AUTH to read and write")
    modes.add_argument("--auth-writes", dest="auth", action="store_const", const="writes",
                       help="require NIP-42 AUTH to write only (reads need none)")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        print("devrelay: --port must be 1..65535 (LocalRelay reports port 0 as 0)", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(args.host, args.port, args.auth))
    except OSError as exc:
        print(f"devrelay: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
