"""The custodian, killed (SIGKILL) after it has done one request of `op` and before it
answers: the worst moment for the pipeline, the effect done and no word of it.

    python -m tests.custodian.crashing_custodian CONFIG OP

OP `backup-write`: killed instead halfway through writing a backup's bytes to disk.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from custody.custodian import backup
from custody.custodian.main import main
from custody.custodian.server import Custodian
from tests.fixtures.kill import kill_at


def _arm_mid_write() -> None:
    write, checkpoint = backup.write_synced, kill_at("custodian", "backup-write")

    def half_then_killed(fd: int, *args: Any) -> None:
        os.write(fd, args[-1][:len(args[-1]) // 2])
        checkpoint("backup-write")
        write(fd, *args)  # pragma: no cover - killed above

    backup.write_synced = half_then_killed  # type: ignore[assignment]


def _arm(op: str) -> None:
    if op == "backup-write":
        return _arm_mid_write()
    handler = Custodian.HANDLERS[op]
    checkpoint = kill_at("custodian", op)

    async def killing(self: Custodian, args: Mapping[str, Any]) -> object:
        result = await handler(self, args)
        checkpoint(op)
        return result

    Custodian.HANDLERS = {**Custodian.HANDLERS, op: killing}


if __name__ == "__main__":
    _arm(sys.argv[2])
    sys.exit(main([sys.argv[1]]))
