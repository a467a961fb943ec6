"""`buzz-broker keys rotate|migrate` as the CLI runs it, SIGKILLed at a named step; and a
check of every agent afterwards.

    python -m tests.custody.crashing_rotation kill CONFIG STEP rotate
    python -m tests.custody.crashing_rotation kill CONFIG STEP migrate TO_CONFIG
    python -m tests.custody.crashing_rotation check CONFIG

`kill`: `daemon.cli.keys.rotate` (the production path) with its test-only checkpoint seam
set to SIGKILL the process at STEP (one of `custody.ROTATION_CHECKPOINTS`): no `finally`,
no flush, as a power cut. Before dying it writes ``crashing_rotation.kill step=STEP`` to
stderr, so the test can tell the checkpoint's kill from any other death.

`check`: opens custody with CONFIG, signs one event as every live agent, and prints one
JSON object {pubkey: true/false (the signature verifies)}; a custody fault is one line
on stderr and exit status 1. A separate process because SoftHSM sees a token made after
its C_Initialize only in a new process (the migration target).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import trio

from tests.fixtures.kill import kill_at



def _check(config_path: str) -> int:
    from custody import Custody, CustodyError, UnsignedEvent, verify_event
    from daemon.config import load_config

    config = load_config(config_path)

    async def main() -> dict[str, bool]:
        opened = await Custody.open(config.pkcs11.token(), Path(config.state.dir))
        try:
            result = {}
            for record in opened.agents():
                signed = await opened.sign_event(
                    record.pubkey, UnsignedEvent(record.pubkey, 1_700_000_000, 1, (), "check"))
                result[record.pubkey] = verify_event(signed.to_json_obj())
            return result
        finally:
            await opened.aclose()

    try:
        print(json.dumps(trio.run(main)))
    except CustodyError as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    return 0


def main() -> int:
    from daemon.cli._common import CliError
    from daemon.cli.keys import rotate

    mode, config, *rest = sys.argv[1:]
    if mode == "check":
        return _check(config)
    step, command, *to = rest
    args = argparse.Namespace(config=config, keys_command=command, new_kek_label=None,
                              to_config=to[0] if to else None)
    try:
        return rotate(args, checkpoint=kill_at("crashing_rotation", step))
    except CliError as exc:
        sys.stderr.write(f"{exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
