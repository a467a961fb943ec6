"""The `backup` row's disk bound (custody/custodian/backup.py): configuration, not the
pipeline, decides how many files the custodian writes, and it never deletes one.

- `[backup] max_files`: with that many `agents-*.age` in `dir` (the operator's own copies
  included, nothing else) the row answers `custody` and writes nothing; once the operator
  moves one away it writes again.
- `[backup] min_interval_seconds`: a request sooner than that after the newest file's
  mtime answers `rate_limited`, also after a restart of the custodian (the mtime is on
  disk); once the interval has passed (the newest file's mtime set back by the test, not
  waited for) it writes again; two requests at once write one file.
- Both reach `buzz-broker keys backup` as one `buzz-broker: custodian: …` line naming the
  setting, exit 1, no traceback, and a `failed` line in the key-event log.
- Bad values are a ConfigError naming the key; the decision itself (`admit_at`) is a pure
  function of the count, the newest mtime and an injected clock, walked as a table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyrage
import pytest

from custody import CustodyError, TokenConfig
from custody.custodian.backup import (
    DEFAULT_MAX_FILES,
    DEFAULT_MIN_INTERVAL,
    Bounds,
    Held,
    TooSoon,
    admit_at,
    held,
)
from custody.custodian.client import CustodianClient, CustodianUnavailable
from custody.custodian.config import ConfigError, load
from daemon.state.directory import AgentDirectory
from tests.backup.test_backup import key_events
from tests.custodian.test_refusals import ask, human
from tests.fixtures.broker import write_config
from tests.fixtures.custodian import CustodianProcess, write_custodian_config
from tests.fixtures.token import REPO

BUZZ_BROKER = REPO / ".venv" / "bin" / "buzz-broker"
HOUR = 3600


# --- the pure decision, as a table -------------------------------------------------------

#: (files held, newest file's age in seconds or None, max_files, min_interval, outcome)
ADMIT = [
    (0, None, 1, HOUR, None),
    (0, None, 1, 0, None),
    (1, None, 1, 0, CustodyError),           # at the cap: refused, however old
    (4, 10 * HOUR, 5, HOUR, None),           # one under it
    (5, 10 * HOUR, 5, HOUR, CustodyError),
    (5, 1.0, 5, HOUR, CustodyError),         # the cap is said before the interval
    (1, HOUR, 5, HOUR, None),                # exactly the interval: admitted
    (1, HOUR - 1, 5, HOUR, TooSoon),
    (1, 0.0, 5, HOUR, TooSoon),
    (1, -60.0, 5, HOUR, TooSoon),            # dated ahead of the clock (a clock set back)
    (1, 0.0, 5, 0, None),                    # 0: no interval
    (1, -60.0, 5, 0, None),
]


@pytest.mark.token_independent
@pytest.mark.parametrize("count, age, max_files, interval, outcome", ADMIT)
def test_admit_at_walks_the_bounds(count: int, age: float | None, max_files: int,
                                   interval: int, outcome: type[Exception] | None) -> None:
    now = 1_800_000_000.0
    files = Held(count, None if age is None else ("agents-x.age", now - age))
    bounds = Bounds(max_files=max_files, min_interval_seconds=interval)
    if outcome is None:
        admit_at(files, bounds, Path("b"), now)
    else:
        with pytest.raises(outcome) as raised:
            admit_at(files, bounds, Path("b"), now)
        assert type(raised.value) is outcome  # TooSoon is not a CustodyError: its own code


@pytest.mark.token_independent
def test_counting_stops_at_the_limit_and_counts_only_the_rows_names(tmp_path: Path) -> None:
    assert held(tmp_path / "absent", 5) == Held(0, None)
    for n in range(30):
        path = tmp_path / f"agents-{n:02d}.age"
        path.write_bytes(b"x")
        os.utime(path, (1_000_000 + n, 1_000_000 + n))
    for other in ("notes.txt", "agents-03.age.sha256", "backup.age", ".agents-x.age.tmp"):
        (tmp_path / other).write_bytes(b"x")
    os.utime(tmp_path / "backup.age", (9_000_000, 9_000_000))  # not the row's: not newest
    assert held(tmp_path, 100) == Held(30, ("agents-29.age", 1_000_029.0))
    assert held(tmp_path, 10).count == 10  # stopped there: at the cap the rest is moot
    assert held(tmp_path, 30).count == 30


# --- configuration -----------------------------------------------------------------------

@pytest.fixture
def recipient() -> str:
    return str(pyrage.x25519.Identity.generate().to_public())


def _with_backup(tmp_path: Path, table: str) -> Path:
    base = write_custodian_config(tmp_path / "c.toml", token=TokenConfig("m", "t", None),
                                  state_dir=tmp_path, socket=tmp_path / "s", relay_url="wss://r")
    base.write_text(base.read_text() + table)
    return base


@pytest.mark.token_independent
@pytest.mark.parametrize("extra, fault", [
    ("max_files = 0", "[backup] max_files must be 1 to 10000, not 0"),
    ("max_files = -3", "[backup] max_files must be 1 to 10000, not -3"),
    ("max_files = 10001", "[backup] max_files must be 1 to 10000, not 10001"),
    ("max_files = 2.5", "[backup] max_files must be a int"),
    ("max_files = true", "[backup] max_files must be a int"),
    ('max_files = "100"', "[backup] max_files must be a int"),
    ("min_interval_seconds = -1", "[backup] min_interval_seconds must be 0 to 604800, not -1"),
    ("min_interval_seconds = 604801",
     "[backup] min_interval_seconds must be 0 to 604800, not 604801"),
    ("min_interval_seconds = 0.5", "[backup] min_interval_seconds must be a int"),
    ("max_file = 10", "unknown key [backup] max_file"),
])
def test_bad_bounds_are_a_config_error_naming_the_key(tmp_path: Path, recipient: str,
                                                      extra: str, fault: str) -> None:
    config = _with_backup(tmp_path, f'[backup]\nrecipients = ["{recipient}"]\ndir = "b"\n'
                                    f"{extra}\n")
    with pytest.raises(ConfigError, match=re.escape(fault)):
        load(str(config))


@pytest.mark.token_independent
def test_bounds_default_and_are_read(tmp_path: Path, recipient: str) -> None:
    table = f'[backup]\nrecipients = ["{recipient}"]\ndir = "b"\n'
    assert load(str(_with_backup(tmp_path, table))).settings.backup_bounds == Bounds(
        max_files=DEFAULT_MAX_FILES, min_interval_seconds=DEFAULT_MIN_INTERVAL)
    set_ = _with_backup(tmp_path, table + "max_files = 7\nmin_interval_seconds = 0\n")
    assert load(str(set_)).settings.backup_bounds == Bounds(max_files=7, min_interval_seconds=0)


# --- the real custodian ------------------------------------------------------------------

def _custodian(custody_state: tuple[TokenConfig, Path], relay_url: str, tmp_path: Path,
               recipient: str, **bounds: int) -> CustodianProcess:
    token, state_dir = custody_state
    socket = tmp_path / "custodian.sock"
    config = write_custodian_config(
        tmp_path / "custodian.toml", token=token, state_dir=state_dir, socket=socket,
        relay_url=relay_url,
        backup={"recipients": [recipient], "dir": str(tmp_path / "backups"), **bounds})
    process = CustodianProcess(config, socket)
    process.start()
    return process


@pytest.fixture
def capped(custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
           recipient: str) -> Iterator[CustodianProcess]:
    process = _custodian(custody_state, local_relay, tmp_path, recipient,
                         max_files=2, min_interval_seconds=0)
    yield process
    process.stop()


@pytest.fixture
def spaced(custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
           recipient: str) -> Iterator[CustodianProcess]:
    process = _custodian(custody_state, local_relay, tmp_path, recipient,
                         max_files=10, min_interval_seconds=HOUR)
    yield process
    process.stop()


def _backup(process: CustodianProcess) -> tuple[bool, object]:
    return ask(process.socket, "backup", names=[])


def _listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def _logged_backups(process: CustodianProcess) -> int:
    log = process.config.parent / "state" / "custodian" / "signed.jsonl"
    return sum(json.loads(line).get("op") == "backup" for line in log.read_text().splitlines())


def _age(directory: Path, seconds: int) -> None:
    """Make every file in `directory` `seconds` older: the interval passes, unwaited."""
    for path in directory.iterdir():
        st = path.stat()
        os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


async def test_the_cap_refuses_past_max_files_and_writes_nothing(
        capped: CustodianProcess, tmp_path: Path) -> None:
    backups = tmp_path / "backups"
    backups.mkdir(mode=0o700)
    (backups / "README").write_text("the operator's note: not the row's, not counted\n")
    (backups / "agents-1.age.sha256").write_text("nor a checksum beside one\n")
    assert _backup(capped)[0] and _backup(capped)[0]
    before = _listing(backups)
    for _ in range(3):
        ok, answer = _backup(capped)
        assert not ok and answer[0] == "custody", answer  # type: ignore[index]
    assert _listing(backups) == before  # nothing written, nothing removed
    assert _logged_backups(capped) == 2
    # The operator moves one off the host: room for one more, and only one.
    moved = sorted(p for p in backups.iterdir() if p.name.endswith(".age"))[0]
    moved.rename(tmp_path / moved.name)
    assert _backup(capped)[0]
    ok, answer = _backup(capped)
    assert not ok and answer[0] == "custody", answer  # type: ignore[index]
    kept = {n for n in before if n.endswith(".age")} - {moved.name}
    rows = {p.name for p in backups.iterdir() if p.name.endswith(".age")}
    assert len(rows) == 2 and kept < rows and (tmp_path / moved.name).exists()
    assert _logged_backups(capped) == 3


async def test_the_interval_refuses_a_backup_too_soon_even_after_a_restart(
        spaced: CustodianProcess, tmp_path: Path) -> None:
    backups = tmp_path / "backups"
    assert _backup(spaced)[0]
    before = _listing(backups)
    ok, answer = _backup(spaced)
    assert not ok and answer[0] == "rate_limited", answer  # type: ignore[index]
    spaced.stop()
    spaced.start()  # the newest file's mtime is on disk: a restart does not reset it
    ok, answer = _backup(spaced)
    assert not ok and answer[0] == "rate_limited", answer  # type: ignore[index]
    assert _listing(backups) == before
    _age(backups, HOUR)
    assert _backup(spaced)[0]
    assert len(_listing(backups)) == 2
    # Two at once once the interval has passed: the check and the write are one step.
    _age(backups, HOUR)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: _backup(spaced), range(2)))
    assert sorted(ok for ok, _ in answers) == [False, True], answers
    assert [a[0] for ok, a in answers if not ok] == ["rate_limited"]  # type: ignore[index]
    assert len(_listing(backups)) == 3
    assert _logged_backups(spaced) == 3


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(BUZZ_BROKER), "--config", str(config), *args],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert "Traceback" not in done.stderr
    return done


async def test_each_refusal_reaches_keys_backup_as_one_line(
        spaced: CustodianProcess, custody_state: tuple[TokenConfig, Path],
        local_relay: str, tmp_path: Path) -> None:
    token, _ = custody_state
    client = CustodianClient(spaced.socket)
    await client.mint_agent(owner=human())
    pipeline_state = tmp_path / "pipeline-state"
    pipeline_state.mkdir(mode=0o700)
    AgentDirectory.open(pipeline_state, client.records).close()
    await client.aclose()
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=pipeline_state,
                          socket=tmp_path / "b.sock", relay_url=local_relay,
                          sections={"custody": {"custodian_socket": str(spaced.socket)}})
    backups = tmp_path / "backups"
    assert _cli(config, "keys", "backup").returncode == 0
    too_soon = _cli(config, "keys", "backup")
    assert too_soon.returncode == 1
    assert too_soon.stderr.startswith("buzz-broker: custodian: ")
    assert too_soon.stderr.count("\n") == 1 and "min_interval_seconds" in too_soon.stderr
    # The directory at the cap: 9 of the operator's copies beside the one written.
    _age(backups, HOUR)
    for n in range(9):
        (backups / f"agents-copy{n}.age").write_bytes(b"x")
    full = _cli(config, "keys", "backup")
    assert full.returncode == 1
    assert full.stderr.startswith("buzz-broker: custodian: ")
    assert full.stderr.count("\n") == 1 and "max_files" in full.stderr
    assert len(list(backups.iterdir())) == 10
    stages = [e["stage"] for e in key_events(pipeline_state) if e["event"] == "backup"]
    assert stages == ["intent", "done", "intent", "failed", "intent", "failed"]


async def test_a_sigkill_mid_write_leaves_no_backup_and_bars_none(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    """Killed halfway through a backup's bytes, the custodian leaves no `agents-*.age`: a
    torn one looked like a backup, counted against max_files, and its mtime refused the
    retry for min_interval_seconds (the default 300 s here)."""
    token, state_dir = custody_state
    recipient = str(pyrage.x25519.Identity.generate().to_public())
    directory = tmp_path / "b"
    custodian = CustodianProcess(write_custodian_config(
        tmp_path / "custodian.toml", token=token, state_dir=state_dir,
        socket=tmp_path / "custodian.sock", relay_url=local_relay,
        backup={"recipients": [recipient], "dir": str(directory)}), tmp_path / "custodian.sock")
    custodian.start(kill_after="backup-write")
    try:
        client = await CustodianClient.open(custodian.socket)
        agent = (await client.mint_agent(owner=human())).pubkey
        with pytest.raises(CustodianUnavailable):
            await client.backup({})
        assert "custodian.kill step=backup-write" in custodian.stderr.read_text()
        assert not list(directory.glob("agents-*.age"))
        custodian.start()
        written = await client.backup({})  # at once: no torn file's mtime bars it
        assert written.agents == (agent,)
        assert [p.name for p in directory.iterdir()] == [Path(written.file).name]
        await client.aclose()
    finally:
        custodian.stop()
