"""One process of the concurrent-process test: opens custody, unseals, closes, in a loop.

    python -m tests.custody.login_churn MODULE TOKEN_LABEL PIN_FILE KEK_LABEL STATE_DIR ROUNDS

Each round is what one CLI command does beside the daemon: `Custody.open` (a C_Login, which
SoftHSM answers by rewriting its token file), an unseal of every live agent (through
`memory_address`, which authenticates, decrypts and re-derives each key), `aclose` (the
process's last user: C_CloseSession logs out). Prints one JSON object: rounds completed,
unseals that opened, and each custody fault's message with its count; a traceback means a
fault custody did not turn into a CustodyError (the test fails on it).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import trio

from custody import Custody, CustodyError, TokenConfig


async def churn(config: TokenConfig, state_dir: Path, rounds: int) -> dict[str, object]:
    faults: collections.Counter[str] = collections.Counter()
    opened = unsealed = 0
    for _ in range(rounds):
        try:
            custody = await Custody.open(config, state_dir)
        except CustodyError as exc:
            faults[f"open: {exc}"] += 1
            continue
        opened += 1
        try:
            for record in custody.agents():
                try:
                    await custody.memory_address(record.pubkey, "core")
                    unsealed += 1
                except CustodyError as exc:
                    faults[f"unseal: {exc}"] += 1
        finally:
            await custody.aclose()
    return {"opened": opened, "unsealed": unsealed, "faults": dict(faults)}


def main(argv: list[str]) -> int:
    module, label, pin_file, kek_label, state_dir, rounds = argv
    config = TokenConfig(module=module, token_label=label, pin_file=pin_file,
                         kek_label=kek_label)
    print(json.dumps(trio.run(churn, config, Path(state_dir), int(rounds))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
