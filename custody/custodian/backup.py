"""The `backup` row's work: every live agent, to the custodian's own recipients and directory.

Why here and not in the pipeline: a compromised pipeline must not turn a backup into key
theft. So the row names neither recipients nor a path (custody/custodian/messages.py);
both are the custodian's configuration (`[backup]`, custody/custodian/config.py), and the
file's name is chosen here: `agents-<UTC time>-<random>.age`, created new (O_EXCL,
O_NOFOLLOW, mode 0600) before anything is unsealed, so an existing file is never
overwritten or followed. Custody encrypts in memory (custody/_backup.py: only ciphertext
leaves it); the file and its directory are fsynced, and on any fault the file is removed.
What the pipeline learns: the file's path, its sha256, the agents in it and the (public)
recipients, for the operator's key-event log. The file restores with `keys restore` like
any other backup.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from custody import Custody, CustodyError
from custody._backup import export_backup

__all__ = ["Written", "write_backup"]


@dataclass(frozen=True, slots=True)
class Written:
    path: Path
    sha256: str
    agents: tuple[str, ...]


def _create(directory: Path) -> tuple[Path, int]:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = f"agents-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}.age"
        path = directory / name
        return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CustodyError(f"cannot create a backup in {directory}: {exc.strerror}") from None


def _write_synced(fd: int, directory: Path, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


async def write_backup(custody: Custody, directory: Path, recipients: Sequence[str],
                       public: Mapping[str, Mapping[str, object]]) -> Written:
    """Write one backup file of every live agent into `directory`.

    Raises:
        CustodyError: the file cannot be created or written, or custody's own faults
            (a public entry over its bound, an agent whose key does not open).
    """
    path, fd = _create(directory)
    done = False
    try:
        exported = await export_backup(custody, recipients, public)
        try:
            await trio.to_thread.run_sync(_write_synced, fd, directory, exported.ciphertext)
        except OSError as exc:
            raise CustodyError(f"cannot write the backup {path.name}: {exc.strerror}") from None
        done = True
        return Written(path=path, sha256=hashlib.sha256(exported.ciphertext).hexdigest(),
                       agents=exported.agents)
    finally:
        os.close(fd)
        if not done:
            path.unlink(missing_ok=True)
