"""`buzz-broker custodian --config FILE` / `python -m custodian FILE`: run the custodian.

Opens custody (token login, KEK check, keystore), then serves the message table on its
socket until SIGTERM/SIGINT. A fault opening is one line on stderr and exit 1. Under
systemd, `Restart=always` brings it back after a crash; the pipeline's client reconnects
on its next request (custodian/client.py).
"""

from __future__ import annotations

import logging
import signal
import sys

import trio

from custody import Custody, CustodyError, harden_process
from custodian.config import ConfigError, load
from custodian.server import Custodian, serve

__all__ = ["main", "run"]


async def run(config_path: str) -> None:
    config = load(config_path)
    harden_process()
    custody = await Custody.open(config.token, config.state_dir, config.cache)
    try:
        custodian = Custodian(custody, config.settings)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(serve, custodian)
                print("custodian: listening", flush=True)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break
    finally:
        with trio.CancelScope(shield=True):
            await custody.aclose()


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--config"]
    if len(args) != 1:
        print("usage: buzz-broker custodian --config FILE", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="custodian: %(message)s", stream=sys.stderr)
    try:
        trio.run(run, args[0])
    except (ConfigError, CustodyError) as exc:
        print(f"custodian: {exc}", file=sys.stderr)
        return 1
    return 0
