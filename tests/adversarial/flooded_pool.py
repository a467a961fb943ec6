"""The relay pool alone, in a process of its own, with one connection per agent to a relay
that floods them: what its memory peaks at is the pool's, not the flooding relay's.

    python -m tests.adversarial.flooded_pool URL AGENTS SECONDS MAX_RECEIVE_BYTES

Opens one connection per agent (a query each, which the relay answers with EOSE), then lets
the relay do what it does for SECONDS. Prints two JSON lines on stdout: ``connected``, with
the process's peak resident memory (VmHWM, KiB) once every connection is open, and
``flooded``, with the peak after SECONDS and how many connections were receiving a frame at
that moment (`RelayPool.frames_receiving`). Used by
tests/adversarial/test_relay_bounds.py::test_frames_held_stay_within_max_receive_bytes_however_many_connections.
"""

from __future__ import annotations

import json
import sys

import trio

from buzzwire.nostr import SignedEvent
from daemon.relay.pool import RelayPool, RelayTimeouts

__all__ = ["main"]


def _peak_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


async def _no_auth(*_args: object) -> SignedEvent:
    raise AssertionError("this relay never asks for AUTH")


async def _run(url: str, agents: int, seconds: float, max_receive_bytes: int) -> None:
    pool = RelayPool(url, _no_auth, timeouts=RelayTimeouts(connect=30, ok=30, eose=30),
                     max_receive_bytes=max_receive_bytes)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        for n in range(agents):
            await pool.query(f"{n:064x}", [{"kinds": [1]}])
        print(json.dumps({"phase": "connected", "hwm_kib": _peak_kib()}), flush=True)
        await trio.sleep(seconds)
        print(json.dumps({"phase": "flooded", "hwm_kib": _peak_kib(),
                          "receiving": pool.frames_receiving}), flush=True)
        nursery.cancel_scope.cancel()


def main(argv: list[str]) -> None:
    url, agents, seconds, max_receive_bytes = argv
    trio.run(_run, url, int(agents), float(seconds), int(max_receive_bytes))


if __name__ == "__main__":
    main(sys.argv[1:])
