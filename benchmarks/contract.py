"""How fast the contract judges a request body, against plain `json.loads` of the same bytes.

Prints, for a realistic message.reply body and a channel.read body, the requests parsed
and validated per second by `read_request`, `json.loads` per second on the same bytes in
the same run, and the ratio (contract / json.loads). Best of several rounds, to damp noise
on a shared machine. Run: python benchmarks/contract.py [--seconds 0.4] (window per round)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from buzzwire.contract import read_request

MESSAGE_REPLY = json.dumps({
    "type": "broker_request",
    "protocolVersion": 1,
    "requestId": "a9f3c2e1-0b5d-4e8a-9c71-3f2b6d8e4a10",
    "actionVersion": 1,
    "action": "message.reply",
    "args": {
        "channelId": "5df7dfa8-e919-43df-8efd-f1dcb8af7071",
        "replyToEventId": "cacf5f811cc8ef3f4af3f92cc222f92a86cdf6a26728a144c8e63b74ab6db359",
        "content": "On it. I'll look at the failing build and report back within the hour — "
                   "the flaky test seems to be the relay fixture again. 🛠️",
        "mentions": ["d31d54af61c73c47053822d496ce341eac337252ee1aa7c41c9751fa3060d121"],
    },
}, ensure_ascii=False).encode()

CHANNEL_READ = json.dumps({
    "type": "broker_request",
    "protocolVersion": 1,
    "requestId": "read-0001",
    "actionVersion": 1,
    "action": "channel.read",
    "args": {
        "channelId": "5DF7DFA8-E919-43DF-8EFD-F1DCB8AF7071",
        "mentionsOnly": True,
        "cursor": "c1.1787675388.0f3e",
        "limit": 50,
    },
}).encode()


def rate(fn: Callable[[bytes], object], body: bytes, seconds: float = 0.4, rounds: int = 5) -> float:
    best = 0.0
    for _ in range(rounds):
        count = 0
        start = time.perf_counter()
        deadline = start + seconds
        while True:
            for _ in range(200):
                fn(body)
            count += 200
            now = time.perf_counter()
            if now >= deadline:
                break
        best = max(best, count / (now - start))
    return best


def main(seconds: float) -> None:
    for name, body in (("message.reply", MESSAGE_REPLY), ("channel.read", CHANNEL_READ)):
        reading = read_request(body)
        assert reading.request is not None, reading.error  # the body must be valid
        contract = rate(read_request, body, seconds)
        baseline = rate(json.loads, body, seconds)
        print(f"{name:14s} {len(body):4d} B  read_request {contract:10,.0f}/s   "
              f"json.loads {baseline:10,.0f}/s   ratio {contract / baseline:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.4, help="window per round")
    main(parser.parse_args().seconds)
