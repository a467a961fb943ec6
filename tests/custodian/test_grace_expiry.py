"""Destroy's grace period ends: past `destroy_grace_seconds` the custodian's sealed copy
of a destroyed key is deleted and `--recover` finds nothing (docs/custodian.md: "Past
the grace period a copy is deleted ... and the destroy is final"). The in-grace half is
tests/custodian/test_refusals.py::test_a_destroyed_key_is_recoverable_within_the_grace_period.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from custody import TokenConfig
from custody.custodian.client import CustodianClient
from custody.custodian.grace import Graveyard
from tests.custodian.test_refusals import ask, held, human
from tests.fixtures.custodian import running_custodian

GRACE = 1


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_copy_past_its_grace_is_purged_at_the_next_keep_and_at_start(tmp_path: Path) -> None:
    graves = Graveyard(tmp_path, GRACE)
    graves.keep("a" * 64, b"sealed a")
    assert graves.take("a" * 64) == b"sealed a"
    _age(tmp_path / ("a" * 64 + ".sealed"), GRACE + 1)
    assert graves.take("a" * 64) is None  # past its grace, never handed back
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
