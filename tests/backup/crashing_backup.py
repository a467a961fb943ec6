"""`buzz-broker keys backup --out FILE` as the operator runs it, SIGKILLed at a named step.

    python -m tests.backup.crashing_backup STEP BUZZ-BROKER-ARGUMENTS...

The program is `daemon.cli.main` (the production code path: key-event log, token login,
custody, the file) with one kill armed from outside, so it needs no seam in the command:

- `export`: inside `custody.export_backup`, once every agent is unsealed and encrypted and
  before it returns: the file has not a byte yet.
- `write`: halfway through the backup's bytes: the first write to a file opened for
  writing in FILE's directory writes half of its bytes, then the kill. Black-box (it does
  not know the file's name), so it cuts the old command, which wrote FILE itself, and the
  new one, which writes a partial file beside it, at the same point.

SIGKILL runs no `finally`, no flush, no atexit: what the OOM killer or a power cut does.
Before dying it writes one line ``crashing_backup.kill step=STEP`` to stderr, so the test
can tell the kill from any other death.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import custody
from daemon.cli import main
from tests.fixtures.kill import kill_at

STEPS = ("export", "write")


def _arm_export() -> None:
    export, checkpoint = custody.export_backup, kill_at("crashing_backup", "export")

    async def exported_then_killed(*args: Any, **kwargs: Any) -> Any:
        result = await export(*args, **kwargs)
        checkpoint("export")
        return result  # pragma: no cover - killed above

    custody.export_backup = exported_then_killed


def _arm_write(directory: Path) -> None:
    real_open, real_write = os.open, os.write
    checkpoint = kill_at("crashing_backup", "write")
    there: set[int] = set()

    def tracking_open(path: Any, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        fd = real_open(path, flags, mode, **kwargs)
        if flags & os.O_WRONLY and Path(path).parent.resolve() == directory:
            there.add(fd)
        return fd

    def half_then_killed(fd: int, data: Any) -> int:
        if fd in there and len(data) > 1:
            real_write(fd, bytes(data[:len(data) // 2]))
            checkpoint("write")
        return real_write(fd, data)

    os.open, os.write = tracking_open, half_then_killed


if __name__ == "__main__":
    step, *argv = sys.argv[1:]
    if step == "export":
        _arm_export()
    elif step == "write":
        _arm_write(Path(argv[argv.index("--out") + 1]).parent.resolve())
    else:
        sys.exit(f"usage: python -m tests.backup.crashing_backup {{{'|'.join(STEPS)}}} ARGS...")
    sys.exit(main(argv))
