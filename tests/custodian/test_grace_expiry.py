"""Destroy's grace period ends: past `destroy_grace_seconds` the custodian's sealed copy
of a destroyed key is deleted and `--recover` finds nothing (docs/custodian.md: "Past
the grace period a copy is deleted ... and the destroy is final"). The in-grace half is
tests/custodian/test_refusals.py::test_a_destroyed_key_is_recoverable_within_the_grace_period.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from custody import TokenConfig
from custody.custodian.client import CustodianClient
from custody.custodian.grace import Graveyard
from custody.custodian.forget import forget_copy
from custody.custodian.recover import kept_copy
from tests.custodian.test_refusals import ask, held, human
from tests.fixtures.custodian import running_custodian

GRACE = 1


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_copy_past_its_grace_is_purged_at_the_next_keep_and_at_start(tmp_path: Path) -> None:
    graves = Graveyard(tmp_path, GRACE)
    graves.keep("a" * 64, b"sealed a")
    assert kept_copy(graves, "a" * 64) == b"sealed a"
    _age(tmp_path / ("a" * 64 + ".sealed"), GRACE + 1)
    assert kept_copy(graves, "a" * 64) is None  # past its grace, never handed back
    graves.keep("b" * 64, b"sealed b")  # the next destroy purges the old copy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b" * 64 + ".sealed"]
    _age(tmp_path / ("b" * 64 + ".sealed"), GRACE + 1)
    Graveyard(tmp_path, GRACE)  # and so does a start
    assert list(tmp_path.iterdir()) == []


def test_the_copies_are_the_custodians_alone_whatever_the_umask(tmp_path: Path) -> None:
    """A copy is a sealed key: the directory is made 0700 and each copy 0600, with an open
    umask too (no reader but the custodian's uid, even of what it cannot unseal)."""
    import stat

    old = os.umask(0)
    try:
        Graveyard(tmp_path / "destroyed", GRACE).keep("a" * 64, b"sealed a")
    finally:
        os.umask(old)
    copies = tmp_path / "destroyed"
    assert stat.S_IMODE(copies.stat().st_mode) == 0o700
    assert [(p.name, stat.S_IMODE(p.stat().st_mode)) for p in copies.iterdir()] == [
        ("a" * 64 + ".sealed", 0o600)]


async def test_past_the_grace_period_recover_finds_no_copy(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    with running_custodian(custody_state, local_relay, tmp_path,
                           settings={"destroy_grace_seconds": GRACE,
                                     "log_dir": str(log_dir)}) as process:
        client = await CustodianClient.open(process.socket)
        agent = await held(client, human())
        assert ask(process.socket, "destroy", pubkey=agent)[0]
        copies = list(log_dir.glob("**/*.sealed"))
        assert [p.name for p in copies] == [f"{agent}.sealed"]
        time.sleep(GRACE + 1.1)
        done = subprocess.run([sys.executable, "-m", "custody.custodian", str(process.config),
                               "--recover", agent], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and "no sealed copy" in done.stderr, done.stderr
        # a later destroy purges it from disk
        assert ask(process.socket, "destroy", pubkey=await held(client, human()))[0]
        assert not copies[0].exists()
        await client.aclose()


def _waits_for_a_lock(pid: int, path: Path) -> bool:
    """Whether process `pid` is blocked on a flock of `path` (/proc/locks: a "->" line)."""
    inode = path.stat().st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        words = line.split()
        if "->" in words and "FLOCK" in words:
            holder, device = words[words.index("->") + 4:words.index("->") + 6]
            if int(holder) == pid and int(device.rsplit(":", 1)[1]) == inode:
                return True
    return False


async def test_a_commands_purge_never_deletes_the_copy_a_destroy_puts_in_its_place(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy past its grace (`--recover` leaves the copy it used, recover.py) is purged by
    an operator's command, in its own process (every `--forget-destroyed` and `--recover`
    purges first), while the custodian destroys that key again and puts a fresh copy at
    the same path. The purge found the old copy past its grace, then deleted the fresh one
    (a race review: the destroy logged, the key lost for good). Now the two take the
    directory's lock: here the destroy is sent once the purge has read the old copy's age,
    and answered only after the purge, its copy in place."""
    with running_custodian(custody_state, "wss://r.example", tmp_path) as process:
        client = await CustodianClient.open(process.socket)
        agent = await held(client, human())
        await client.aclose()
        assert ask(process.socket, "destroy", pubkey=agent)[0]
        [copy] = (tmp_path / "state").glob(f"**/destroyed/{agent}.sealed")
        recovered = subprocess.run([sys.executable, "-m", "custody.custodian",
                                    str(process.config), "--recover", agent],
                                   capture_output=True, text=True, timeout=60)
        assert recovered.returncode == 0 and copy.is_file(), recovered.stderr
        _age(copy, 8 * 86400)  # past the default grace of 7 days
        answers: list[tuple[bool, object]] = []
        destroy = threading.Thread(
            target=lambda: answers.append(ask(process.socket, "destroy", pubkey=agent)))
        stat = Path.stat

        def the_destroy_lands_after_the_age_is_read(self: Path, **kwargs: bool) -> os.stat_result:
            result = stat(self, **kwargs)
            if self == copy and not destroy.is_alive() and not answers:
                destroy.start()  # answered at once unless the purge holds the lock
                while destroy.is_alive() and not _waits_for_a_lock(
                        process.proc.pid, copy.parent):
                    time.sleep(0.01)
            return result

        monkeypatch.setattr(Path, "stat", the_destroy_lands_after_the_age_is_read)
        Graveyard(copy.parent, 7 * 86400)  # the command's: it purges as it is made
        monkeypatch.undo()
        destroy.join(30)
        assert answers and answers[0][0], answers
        assert copy.is_file() and time.time() - copy.stat().st_mtime < 60, "the fresh copy is gone"
        again = subprocess.run([sys.executable, "-m", "custody.custodian", str(process.config),
                                "--recover", agent], capture_output=True, text=True, timeout=60)
        assert again.returncode == 0, again.stderr


def test_the_purge_keeps_a_copy_within_its_grace_and_drops_one_just_past_it(
        tmp_path: Path) -> None:
    """The purge's bound is the grace period itself: half a second either side of it
    (the test above ages by grace + 1 s at a grace of 1 s, which a bound of twice the grace
    would still pass)."""
    graves = Graveyard(tmp_path, 10)
    graves.keep("a" * 64, b"sealed a")
    graves.keep("b" * 64, b"sealed b")
    _age(tmp_path / ("a" * 64 + ".sealed"), 10.5)
    _age(tmp_path / ("b" * 64 + ".sealed"), 9.5)
    assert graves.purge() == ["b" * 64]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b" * 64 + ".sealed"]


def test_a_commands_delete_of_a_copy_waits_for_the_copies_lock(tmp_path: Path) -> None:
    """forget.py's `forget_copy` (a named forget, `keys rotate`'s abandoned keys) deletes
    under the same lock as the custodian's `keep` and `purge`: while another holds it, the
    copy stays; once it is released, the copy goes."""
    graves = Graveyard(tmp_path, GRACE)
    graves.keep("a" * 64, b"sealed a")
    with graves.locked():  # another open of the directory: as another process's flock
        deleting = threading.Thread(target=forget_copy, args=(graves, "a" * 64))
        deleting.start()
        deleting.join(0.3)
        assert deleting.is_alive() and graves.path("a" * 64).is_file()
    deleting.join(10)
    assert not deleting.is_alive() and not graves.path("a" * 64).exists()
