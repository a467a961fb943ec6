"""The `backup` row's work: every live agent, to the custodian's own recipients and directory.

Why here and not in the pipeline: a compromised pipeline must not turn a backup into key
theft. So the row names neither recipients nor a path (custody/custodian/messages.py);
both are the custodian's configuration (`[backup]`, custody/custodian/config.py), and the
file's name is chosen here: `agents-<UTC time>-<random>.age`, written first as
`.<name>.partial`, created new (O_EXCL, O_NOFOLLOW, mode 0600) before anything is
unsealed, and linked to its name once whole and fsynced (link, not rename: an existing
file is never overwritten or followed; a crash leaves no torn backup, and the next write
removes its partial file: `write_synced`, which `keys backup --out` shares). Custody
encrypts in memory (custody/_backup.py: only ciphertext leaves it); the directory is
fsynced, and on any fault the file is removed.
What the pipeline learns: the file's path, its sha256, the agents in it and the (public)
recipients, for the operator's key-event log. The file restores with `keys restore` like
any other backup.

Disk is bounded by `Bounds` (`[backup] max_files`, `min_interval_seconds`), never by how
often the pipeline asks, and no backup is ever deleted here (an old one may hold the only
copy of a key destroyed since): past `max_files` files named `agents-*.age` in the
directory (whoever put them there) the row answers `custody`, as for a full disk, until
the operator moves some away; sooner than `min_interval_seconds` after the newest one's
mtime it answers `rate_limited`. The mtime, not a clock in memory, so the interval holds
across a restart. The caller serializes requests: the check and the write are one step.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from custody import Custody, CustodyError
from custody._backup import export_backup

__all__ = ["Bounds", "Held", "TooSoon", "Written", "admit_at", "held", "write_backup",
           "write_synced"]

#: `[backup] max_files`: 100 backups of 1,000 agents take 32 to 52 MB (measured: 0.32 KB
#: an agent, 0.52 with a NIP-OA tag; docs/custodian.md). At most 10,000: each request
#: counts up to that many names.
DEFAULT_MAX_FILES, MAX_FILES = 100, 10_000
#: `[backup] min_interval_seconds`: 5 minutes (100 files take a flooding pipeline 8 hours);
#: 0 turns it off; at most a week, beyond which it would bar the operator's own backups.
DEFAULT_MIN_INTERVAL, MAX_MIN_INTERVAL = 300, 7 * 86400


@dataclass(frozen=True, slots=True, kw_only=True)
class Bounds:
    max_files: int = DEFAULT_MAX_FILES
    min_interval_seconds: int = DEFAULT_MIN_INTERVAL

    def __post_init__(self) -> None:
        if not 1 <= self.max_files <= MAX_FILES:
            raise ValueError(f"max_files must be 1 to {MAX_FILES}, not {self.max_files}")
        if not 0 <= self.min_interval_seconds <= MAX_MIN_INTERVAL:
            raise ValueError(f"min_interval_seconds must be 0 to {MAX_MIN_INTERVAL}, "
                             f"not {self.min_interval_seconds}")


@dataclass(frozen=True, slots=True)
class Held:
    """The row's files in the directory, counted up to a limit; the newest (name, mtime)
    among them (exact only under the limit: at it, the row is refused anyway)."""

    count: int
    newest: tuple[str, float] | None


class TooSoon(Exception):
    """Asked sooner than `min_interval_seconds` after the last backup (`rate_limited`)."""


def held(directory: Path, limit: int) -> Held:
    """Count `agents-*.age` in `directory`, stopping at `limit` (no listing is kept)."""
    count, newest = 0, None
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if not (entry.name.startswith("agents-") and entry.name.endswith(".age")):
                    continue
                try:
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue  # moved away by the operator while we counted
                count += 1
                if newest is None or mtime > newest[1]:
                    newest = (entry.name, mtime)
                if count >= limit:
                    break
    except FileNotFoundError:
        pass  # no backup yet: `_create` makes the directory
    except OSError as exc:
        raise CustodyError(f"cannot read the backup directory {directory}: "
                           f"{exc.strerror}") from None
    return Held(count, newest)


def admit_at(files: Held, bounds: Bounds, directory: Path, now: float) -> None:
    """Raise unless one more backup fits `bounds` at `now` (pure: the clock is given).

    Raises:
        CustodyError: `max_files` are held (answered `custody`, as a full disk).
        TooSoon: the newest is younger than `min_interval_seconds` at `now`.
    """
    if files.count >= bounds.max_files:
        raise CustodyError(f"{directory} holds {bounds.max_files} backups (agents-*.age), the "
                           f"custodian's [backup] max_files: move some out of it (copy them off "
                           f"the host first) or raise max_files, then ask again")
    # A newest file dated ahead of `now` (the clock set back) is refused until the interval
    # after its date (the message says how long; the operator can move it); 0: no interval.
    interval = bounds.min_interval_seconds
    if interval and files.newest is not None and now - files.newest[1] < interval:
        wait = math.ceil(files.newest[1] + interval - now)
        raise TooSoon(f"the last backup, {files.newest[0]}, is younger than the custodian's "
                      f"[backup] min_interval_seconds ({interval} s): ask again in {wait} s")


@dataclass(frozen=True, slots=True)
class Written:
    path: Path
    sha256: str
    agents: tuple[str, ...]


def _create(directory: Path) -> tuple[Path, int]:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for torn in directory.glob(".agents-*.age.partial"):  # a crash's, mid-write
            torn.unlink()
        name = f"agents-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}.age"
        path = directory / name
        return path, os.open(_partial(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL
                             | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CustodyError(f"cannot create a backup in {directory}: {exc.strerror}") from None


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def write_synced(fd: int, partial: Path, path: Path, data: bytes) -> None:
    """`data` into `fd` (the new file `partial`), fsynced, linked to `path` (an existing
    one raises FileExistsError, left alone), the directory fsynced: whole or not there."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)
    os.link(partial, path)
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


async def write_backup(custody: Custody, directory: Path, recipients: Sequence[str],
                       public: Mapping[str, Mapping[str, object]], bounds: Bounds,
                       now: float) -> Written:
    """Write one backup file of every live agent into `directory`, if `bounds` admit one
    at `now` (the caller holds its lock over this call: two at once would both fit).

    Raises:
        TooSoon, CustodyError: as `admit_at`; nothing is created then.
        CustodyError: the file cannot be created or written, or custody's own faults
            (a public entry over its bound, an agent whose key does not open).
    """
    files = await trio.to_thread.run_sync(held, directory, bounds.max_files)
    admit_at(files, bounds, directory, now)
    path, fd = _create(directory)
    try:
        exported = await export_backup(custody, recipients, public)
        try:
            await trio.to_thread.run_sync(write_synced, fd, _partial(path), path,
                                           exported.ciphertext)
        except OSError as exc:
            raise CustodyError(f"cannot write the backup {path.name}: {exc.strerror}") from None
        return Written(path=path, sha256=hashlib.sha256(exported.ciphertext).hexdigest(),
                       agents=exported.agents)
    finally:
        os.close(fd)
        _partial(path).unlink(missing_ok=True)  # linked to `path` once whole, else a fault's
