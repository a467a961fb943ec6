"""The custodian, killed (SIGKILL) after it has done one request of `op` and before it
answers: the worst moment for the pipeline, the effect done and no word of it.

    python -m tests.custodian.crashing_custodian CONFIG OP [ARGUMENTS...]

OP `backup-write`: killed instead halfway through writing a backup's bytes to disk.
OP `mint:intent` (`import`, `destroy`, `attach_auth` likewise): killed once the row's
intent line is on disk, before custody is asked; `mint:changed`: once custody's change
returned, before its outcome line (the write-ahead's two windows, server.py `_change`).
ARGUMENTS: the custodian's command instead of serving. `keys rotate`: OP is then one of
`custody.ROTATION_CHECKPOINTS` (killed there), or `released`: stopped (SIGSTOP) once the
rotation has let the state lock go, so the test can start a custodian in that window.
`keys restore`: OP `restore:intent` or `restore:changed`, the same two windows around
`restore_backup` (custody/custodian/keys.py, through changes.py `logged_change`).
`--recover PUBKEY`: OP `recover:intent` or `recover:changed`, around `revive_agent`
(custody/custodian/recover.py). `--forget-destroyed` (past the grace period): OP
`forget:intent` or `forget:changed`, around `forget_destroyed`'s committed transaction
(custody/custodian/forget.py).
"""

from __future__ import annotations

import functools
import inspect
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from custody import Custody
from custody import _restore as restoring
from custody._statelock import StateLock
from custody.custodian import backup
from custody.custodian import forget as forgetting
from custody.custodian import keys as key_commands
from custody.custodian import recover as recovering
from custody.custodian.ledger import SignLog
from custody.custodian.main import main
from custody.custodian.server import Custodian
from tests.fixtures.kill import kill_at

#: A row that changes the keystore (and `keys restore`, `--recover`, `--forget-destroyed`)
#: -> where the call that makes its change is looked up when called, and its name there.
CHANGES: dict[str, tuple[object, str]] = {
    "mint": (Custody, "mint_agent"), "import": (Custody, "import_agent"),
    "destroy": (Custody, "destroy_agent"), "attach_auth": (Custody, "attach_auth_tag"),
    "restore": (restoring, "restore_backup"), "recover": (recovering, "revive_agent"),
    "forget": (forgetting, "forget_destroyed")}


def _arm_mid_write() -> None:
    write, checkpoint = backup.write_synced, kill_at("custodian", "backup-write")

    def half_then_killed(fd: int, *args: Any) -> None:
        os.write(fd, args[-1][:len(args[-1]) // 2])
        checkpoint("backup-write")
        write(fd, *args)  # pragma: no cover - killed above

    backup.write_synced = half_then_killed  # type: ignore[assignment]


def _arm_intent(op: str) -> None:
    append, checkpoint = SignLog.append, kill_at("custodian", f"{op}:intent")

    def then_killed(self: SignLog, entries: list[dict[str, object]], **kw: bool) -> int:
        seq = append(self, entries, **kw)
        if entries and entries[0].get("for") == op:
            checkpoint(f"{op}:intent")
        return seq

    SignLog.append = then_killed  # type: ignore[method-assign]


def _arm_changed(op: str) -> None:
    owner, name = CHANGES[op]
    change, checkpoint = getattr(owner, name), kill_at("custodian", f"{op}:changed")

    async def then_killed(*args: Any, **kw: Any) -> object:  # a method's self among them
        record = await change(*args, **kw)
        checkpoint(f"{op}:changed")
        return record

    def then_killed_now(*args: Any, **kw: Any) -> object:  # forget's plain transaction
        result = change(*args, **kw)
        checkpoint(f"{op}:changed")
        return result

    setattr(owner, name, then_killed if inspect.iscoroutinefunction(change) else then_killed_now)


def _arm_rotation(step: str) -> None:
    if step != "released":
        rotate = key_commands.__dict__["rotate_keys"]
        setattr(key_commands, "rotate_keys",
                functools.partial(rotate, checkpoint=kill_at("custodian", step)))
        return
    release, stop = StateLock.release, kill_at("custodian", step, signal.SIGSTOP)

    def then_stopped(self: StateLock) -> None:
        release(self)
        stop(step)

    StateLock.release = then_stopped  # type: ignore[method-assign]


def _arm(op: str) -> None:
    if op == "backup-write":
        return _arm_mid_write()
    row, _, point = op.partition(":")
    if point:
        return {"intent": _arm_intent, "changed": _arm_changed}[point](row)
    handler = Custodian.HANDLERS[op]
    checkpoint = kill_at("custodian", op)

    async def killing(self: Custodian, args: Mapping[str, Any]) -> object:
        result = await handler(self, args)
        checkpoint(op)
        return result

    Custodian.HANDLERS = {**Custodian.HANDLERS, op: killing}


if __name__ == "__main__":
    if sys.argv[3:] and ":" not in sys.argv[2]:
        _arm_rotation(sys.argv[2])
    else:
        _arm(sys.argv[2])
    sys.exit(main([sys.argv[1], *sys.argv[3:]]))
