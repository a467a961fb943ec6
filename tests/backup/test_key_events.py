"""The key-event log (issue 18): what `keys backup|restore|rotate|migrate` record, when, and
how `buzz-broker audit verify` finds an edit, a deleted line or a cut tail.

Real parts: the session's token and the `buzz-broker` command line (a process each run);
the log's damage is made with ordinary file edits, as whoever could write the state
directory would make it. Shapes and chunking are checked in-process.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from custody import TokenConfig
from daemon.cli._common import CliError
from daemon.cli._key_trail import recorded
from daemon.cli.audit import EXIT_BROKEN
from daemon.state.audit import (
    MAX_KEY_PUBKEYS,
    AuditUnavailable,
    KeyAction,
    KeyEvent,
    KeyStage,
    _check_line,
    _encode_line,
    _read_entry,
    audit_files,
    verify,
)
from daemon.state import key_events
from daemon.state.key_events import HEAD_FILE, KEY_EVENTS_DIRNAME, LEGACY_FILE
from tests.adversarial._daemon import DaemonProcess, setup_state, write_config
from tests.backup.test_backup import Host, age_identity, key_event_bytes, key_events as events_of
from tests.custody._secrets import PUB_2, PUB_3, SECRET_1, SECRET_X, assert_no_secrets
from tests.custody.test_cli import BUZZ_BROKER
from tests.custody.test_rotation import second_token  # noqa: F401  (a fixture)
from tests.fixtures.token import SoftHsmToken

RECIPIENT = "age1" + "q" * 58
OP = "0123456789abcdef"


@dataclass(frozen=True)
class Logged:
    """One host whose key-event log holds each kind of event (made once per module)."""

    host: Host
    identity: Path
    out: Path
    secrets: list[bytes]


def _stages(state: Path) -> list[tuple[str, str]]:
    return [(str(e["event"]), str(e["stage"])) for e in events_of(state)]


@pytest.fixture(scope="module")
def logged(softhsm_token: SoftHsmToken, tmp_path_factory: pytest.TempPathFactory) -> Logged:
    directory = tmp_path_factory.mktemp("key-events")
    host = Host(softhsm_token, directory / "host")
    assert host("agent", "import", "--owner", PUB_2, stdin=SECRET_X).returncode == 0
    assert host("agent", "import", "--owner", PUB_3, stdin=SECRET_1).returncode == 0
    identity, out = directory / "identity.txt", directory / "agents.age"
    done = host("keys", "backup", "--recipient", age_identity(identity), "--out", str(out))
    assert done.returncode == 0, done.stderr
    # A backup that fails after its intent (the file exists): four records in all, so
    # each test sees the same log whichever runs first (a -k selection included).
    again = host("keys", "backup", "--recipient", RECIPIENT, "--out", str(out))
    assert again.returncode == 1
    # Everything that must never reach the log: the identity file, the PIN, the keys.
    secrets = [identity.read_bytes(), Path(softhsm_token.pin_file).read_bytes().strip()]
    return Logged(host, identity, out, secrets)


def _no_secret_in(logged: Logged, state: Path) -> None:
    data = key_event_bytes(state)
    assert_no_secrets(data)
    for secret in logged.secrets:
        assert secret not in data
    assert b"AGE-SECRET-KEY" not in data


def test_backup_and_restore_write_an_intent_then_their_outcome(
    logged: Logged, softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    host, state = logged.host, logged.host.cli.state
    backup, done = events_of(state)[:2]
    assert (backup["stage"], done["stage"], backup["op"]) == ("intent", "done", done["op"])
    assert backup["recipients"] == done["recipients"] and len(done["recipients"]) == 1
    assert backup["agents"] is None and backup["pubkeys"] == [] and backup["sha256"] is None
    assert done["agents"] == 2 and len(done["pubkeys"]) == 2 and done["file"] == str(logged.out)
    assert (done["uid"], done["user"]) == (os.getuid(), key_events.operator()[1])

    # The fixture's second backup failed after its intent (the file exists): the fault.
    failed = events_of(state)[3]
    assert (failed["event"], failed["stage"]) == ("backup", "failed")
    assert "exists" in str(failed["fault"]) and failed["sha256"] is None

    target = Host(softhsm_token, tmp_path / "target")
    stranger = tmp_path / "stranger.txt"
    age_identity(stranger)
    refused = target("keys", "restore", "--identity", str(stranger), str(logged.out), "--yes")
    assert refused.returncode == 1
    restored = target("keys", "restore", "--identity", str(logged.identity), str(logged.out),
                      "--yes")
    assert restored.returncode == 0, restored.stderr
    lines = events_of(target.cli.state)
    assert [(e["event"], e["stage"]) for e in lines] == [
        ("restore", "intent"), ("restore", "failed"), ("restore", "intent"), ("restore", "done")]
    assert "does not decrypt" in str(lines[1]["fault"])
    assert sorted(lines[3]["pubkeys"]) == sorted(done["pubkeys"])
    assert lines[2]["sha256"] == lines[3]["sha256"] == done["sha256"]
    _no_secret_in(logged, state)
    _no_secret_in(logged, target.cli.state)


@pytest.mark.token_offers("GENERATE_KEY")  # rotation without --new-kek-label makes one
def test_rotate_and_migrate_write_an_intent_then_their_outcome(
    softhsm_token: SoftHsmToken, second_token: str, tmp_path: Path  # noqa: F811
) -> None:
    host = Host(softhsm_token, tmp_path / "host")
    assert host("agent", "import", "--owner", PUB_2, stdin=SECRET_X).returncode == 0
    rotated = host("keys", "rotate")
    assert rotated.returncode == 0, rotated.stderr
    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text(host.cli.config.read_text().replace(
        f'token_label = "{softhsm_token.label}"', 'token_label = "no-such-token"'))
    missing = host("keys", "migrate", "--to-config", str(elsewhere))
    assert missing.returncode == 1
    target = tmp_path / "target.toml"
    target.write_text(host.cli.config.read_text().replace(
        f'token_label = "{softhsm_token.label}"', f'token_label = "{second_token}"'))
    moved = host("keys", "migrate", "--to-config", str(target))
    assert moved.returncode == 0, moved.stderr

    lines = events_of(host.cli.state)
    assert [(e["event"], e["stage"]) for e in lines] == [
        ("rotate", "intent"), ("rotate", "done"), ("migrate", "intent"), ("migrate", "failed"),
        ("migrate", "intent"), ("migrate", "done")]
    intent, done = lines[0], lines[1]
    assert intent["oldKek"] is None and intent["oldToken"] == softhsm_token.label
    assert (done["oldToken"], done["oldKek"]) == (softhsm_token.label, host.cli.kek_label)
    assert done["newKek"] not in (None, host.cli.kek_label) and done["agents"] == 1
    assert lines[3]["newToken"] == "no-such-token" and lines[3]["fault"]
    assert (lines[5]["oldKek"], lines[5]["newToken"]) == (done["newKek"], second_token)
    assert_no_secrets(key_event_bytes(host.cli.state))


def _copy_state(logged: Logged, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the logged host's key-event log and anchor; (state dir, config)."""
    state = tmp_path / "state"
    state.mkdir()
    shutil.copytree(logged.host.cli.state / KEY_EVENTS_DIRNAME, state / KEY_EVENTS_DIRNAME)
    shutil.copy(logged.host.cli.state / HEAD_FILE, state / HEAD_FILE)
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    return state, config


def _verify(config: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(BUZZ_BROKER), "--config",
                           str(config), "audit", "verify"], capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items()
                                           if k != "BUZZ_BROKER_CONFIG"})
    assert "Traceback" not in done.stderr
    return done


def _edit_a_count(lines: list[bytes]) -> list[bytes]:
    lines[1] = lines[1].replace(b'"agents":2', b'"agents":3')
    return lines


def _delete_line_two(lines: list[bytes]) -> list[bytes]:
    return lines[:1] + lines[2:]


def _cut_the_tail(lines: list[bytes]) -> list[bytes]:
    return lines[:-1]


# {n}: how many records the log held (other tests of the module may have added some).
@pytest.mark.parametrize("damage, expected", [
    (_edit_a_count, "broken: audit-000001.jsonl line 2: digest does not match the record"),
    (_delete_line_two, "broken: audit-000001.jsonl line 2: prev does not chain"),
    (_cut_the_tail, "broken: the log ends at record {m} but the anchored head is record {n}"),
])
def test_audit_verify_reports_an_edit_a_deleted_line_and_a_cut_tail(
    logged: Logged, tmp_path: Path, damage: object, expected: str
) -> None:
    state, config = _copy_state(logged, tmp_path)
    log = audit_files(state / KEY_EVENTS_DIRNAME)[0][1]
    lines = log.read_bytes().splitlines(keepends=True)
    whole = _verify(config)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "audit log: none at" in whole.stdout
    assert f"key-event log: ok {len(lines)} records; head " in whole.stdout
    assert b'"agents":2' in lines[1]  # the first backup's outcome
    log.write_bytes(b"".join(damage(list(lines))))  # type: ignore[operator]
    broken = _verify(config)
    assert broken.returncode == EXIT_BROKEN, broken.stdout + broken.stderr
    assert "key-event log: " + expected.format(m=len(lines) - 1, n=len(lines)) in broken.stdout
    # A head kept elsewhere (what verify printed) checks one log given by path.
    head = whole.stdout.split("key-event log: ok ")[1].split("\n")[0].split()[-1]
    log.write_bytes(b"".join(lines))
    kept = [str(BUZZ_BROKER), "audit", "verify", str(state / KEY_EVENTS_DIRNAME), "--head"]
    assert subprocess.run([*kept, head], capture_output=True).returncode == 0
    wrong = f"{len(lines)}:{'0' * 64}"
    assert subprocess.run([*kept, wrong], capture_output=True).returncode == EXIT_BROKEN
    log.write_bytes(b"".join(damage(list(lines))))  # type: ignore[operator]
    # A command does not continue a broken log (a line after a cut would hide the cut):
    # the intent cannot be written, so the backup does not run.
    host = logged.host
    config_text = host.cli.config.read_text().replace(str(host.cli.state), str(state))
    other = tmp_path / "other.toml"
    other.write_text(config_text)
    out = tmp_path / "refused.age"
    refused = subprocess.run([str(BUZZ_BROKER), "--config", str(other),
                              "keys", "backup", "--recipient", RECIPIENT, "--out", str(out)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "the key-event log is broken" in refused.stderr
    assert refused.stderr.count("\n") == 1 and not out.exists()


def test_audit_verify_reports_a_deleted_log_and_notes_the_old_plain_file(
    logged: Logged, tmp_path: Path
) -> None:
    state, config = _copy_state(logged, tmp_path)
    legacy = b'{"event":"backup","agents":1}\n'
    (state / LEGACY_FILE).write_bytes(legacy)
    ok = _verify(config)
    assert ok.returncode == 0 and "plain, unchained key events" in ok.stdout
    shutil.rmtree(state / KEY_EVENTS_DIRNAME)
    gone = _verify(config)
    assert gone.returncode == EXIT_BROKEN
    assert "key-event log: broken: " in gone.stdout and "the log was deleted" in gone.stdout
    assert (state / LEGACY_FILE).read_bytes() == legacy  # kept as it was
    # Kept as evidence, the anchor too (docs/install.md): the next command starts afresh.
    (state / HEAD_FILE).rename(state / "key-events.head.broken")
    key_events.write(state, [_intent()])
    fresh = _verify(config)
    assert fresh.returncode == 0 and "key-event log: ok 1 records" in fresh.stdout
    shown = subprocess.run([str(BUZZ_BROKER), "audit", "show", "--path",
                            str(state / KEY_EVENTS_DIRNAME)], capture_output=True, text=True)
    assert shown.returncode == 0 and "keys.backup" in shown.stdout, shown.stderr


def _keystore(host: Host) -> dict[str, list[tuple[object, ...]]]:
    """Every row of custody's keystore: the sealed blobs, the active KEK, any rotation plan."""
    db = sqlite3.connect(f"file:{host.cli.state / 'keystore.db'}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: sorted(db.execute(f'SELECT * FROM "{t}"').fetchall(), key=repr) for t in tables}
    finally:
        db.close()


@pytest.mark.parametrize("obstacle", ["a file", "a symlinked log file"])
def test_an_intent_that_cannot_be_written_stops_the_command_before_anything_moves(
    softhsm_token: SoftHsmToken, logged: Logged, tmp_path: Path, obstacle: str,
    request: pytest.FixtureRequest,
) -> None:
    host = Host(softhsm_token, tmp_path / "host")
    # The migration target: a second token beside the session's (SoftHSM), so the migrate
    # below is one that would move every agent if it got past its intent. A kind with one
    # token names another label, which no token has: the command must stop before any
    # token either way (its own token is refused as "the same token" before the intent),
    # and backup, restore and rotate still run there (the fixture would skip the test).
    other = (request.getfixturevalue("second_token") if softhsm_token.kind == "softhsm"
             else f"{softhsm_token.label}-none")
    target = tmp_path / "target.toml"
    target.write_text(host.cli.config.read_text().replace(
        f'token_label = "{softhsm_token.label}"', f'token_label = "{other}"'))
    assert host("agent", "import", "--owner", PUB_2, stdin=SECRET_X).returncode == 0
    log_dir = host.cli.state / KEY_EVENTS_DIRNAME
    if obstacle == "a file":
        log_dir.write_bytes(b"")  # a file where the directory should be
    else:
        log_dir.mkdir(mode=0o700)  # root ignores modes: a symlink stops even root
        (log_dir / "audit-000001.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    before = (_keystore(host), host.agents())
    # No PIN from here on: a command that reached the token at all would fail on that,
    # so the error naming the key-event log shows the intent came first.
    host.cli.write_config(str(tmp_path / "no-pin"))
    out = tmp_path / "out.age"
    for argv in (("keys", "backup", "--recipient", RECIPIENT, "--out", str(out)),
                 ("keys", "restore", "--identity", str(logged.identity), str(logged.out),
                  "--yes"),
                 ("keys", "rotate", "--new-kek-label", "never-made"),
                 ("keys", "migrate", "--to-config", str(target))):
        done = host(*argv)
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.count("\n") == 1
        assert done.stderr.startswith("buzz-broker: cannot write the key-event log ")
        assert not out.exists()
        assert (_keystore(host), host.agents()) == before  # nothing sealed, resealed, named
    assert not (tmp_path / "elsewhere.jsonl").exists()


_WRITER = """
import sys, time
from pathlib import Path
from daemon.state import key_events
from daemon.state.audit import KeyAction, KeyEvent, KeyStage
for i in range(5):
    event = KeyEvent(at=time.time(), op=sys.argv[2], action=KeyAction.ROTATE,
                     stage=KeyStage.INTENT, uid=0, user=None, old_token="t")
    key_events.write(Path(sys.argv[1]), [event])
"""


def test_writers_at_once_take_turns_and_a_held_lock_is_a_clear_error(
    logged: Logged, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Processes, as two operators' commands are: the lock is a flock between processes.
    host = logged.host
    before = len(events_of(host.cli.state))
    ops = [f"{i:016x}" for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(host.cli.state), op],
                              stderr=subprocess.PIPE) for op in ops]
    for proc in procs:
        _stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
    lines = events_of(host.cli.state)  # (verifies the chain: it did not fork)
    assert sorted(str(e["op"]) for e in lines[before:]) == sorted(ops * 5)
    assert [e["seq"] for e in lines] == list(range(1, len(lines) + 1))

    directory = host.cli.state / KEY_EVENTS_DIRNAME
    held = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        event = KeyEvent(at=1.0, op=OP, action=KeyAction.BACKUP, stage=KeyStage.INTENT,
                         uid=0, user=None, recipients=(RECIPIENT,))
        with pytest.raises(AuditUnavailable) as caught:
            key_events.write(host.cli.state, [event], lock_wait=0.2)
        assert caught.value.busy and "waited 0.2 s" in caught.value.detail
        # What the command says (a shorter wait than the commands' 10 s).
        monkeypatch.setattr(key_events, "LOCK_WAIT_SECONDS", 0.2)
        with pytest.raises(CliError, match="another command is writing it"):
            with recorded(host.cli.state, KeyAction.BACKUP, recipients=(RECIPIENT,)):
                pass  # pragma: no cover - the intent is refused
    finally:
        os.close(held)
    assert events_of(host.cli.state) == lines


def _intent(**changes: object) -> KeyEvent:
    base = KeyEvent(at=1.0, op=OP, action=KeyAction.BACKUP, stage=KeyStage.INTENT, uid=0,
                    user="root", file="/x.age", recipients=(RECIPIENT,))
    return replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("changes", [
    {"op": "XYZ"},
    {"recipients": ()},                                   # a backup names its recipients
    {"recipients": (), "file": None, "stage": KeyStage.DONE, "agents": 0},  # ... once done
    {"recipients": ("age1notakey",)},
    {"pubkeys": ("ab" * 32,)},                            # an intent moved nothing yet
    {"stage": KeyStage.DONE},                             # a done outcome counts agents
    {"stage": KeyStage.DONE, "agents": 0, "fault": "x"},  # a fault is a failure's only
    {"stage": KeyStage.FAILED},                           # ... and a failure has one
    {"old_kek": "k"},                                     # a backup has no KEK labels
    {"uid": -1},
    {"sha256": "AB" * 32},
    {"file": "é" * 1000},                                 # 6000 bytes once escaped
    {"stage": KeyStage.DONE, "agents": 1, "pubkeys": ("ab" * 32, "cd" * 32)},
])
@pytest.mark.token_independent
def test_a_key_event_refuses_a_malformed_shape(changes: dict[str, object]) -> None:
    with pytest.raises((ValueError, TypeError)):
        _intent(**changes)


@pytest.mark.token_independent
def test_a_key_event_round_trips_and_a_long_outcome_is_split() -> None:
    keys = tuple(f"{i:064x}" for i in range(MAX_KEY_PUBKEYS * 2 + 1))
    done = _intent(stage=KeyStage.DONE, agents=len(keys), sha256="ab" * 32)
    parts = key_events.outcome_lines(done, keys)
    assert [len(p.pubkeys) for p in parts] == [MAX_KEY_PUBKEYS, MAX_KEY_PUBKEYS, 1]
    assert tuple(k for p in parts for k in p.pubkeys) == keys
    for part in parts:
        line = _encode_line(part, seq=1, prev="00" * 32)
        obj, reason = _check_line(line)
        assert reason is None and obj is not None and _read_entry(obj) == replace(part, at=1.0)
        assert json.loads(line)["phase"] == "key"


@pytest.mark.token_independent
def test_a_written_log_verifies_and_each_write_moves_the_anchor(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = key_events.write(state, [_intent()])
    assert key_events.read_head(state) == first
    second = key_events.write(state, key_events.outcome_lines(
        _intent(stage=KeyStage.DONE, agents=300, sha256="ab" * 32),
        [f"{i:064x}" for i in range(300)]))
    assert second[0] == 3 and key_events.read_head(state) == second
    assert verify(state / KEY_EVENTS_DIRNAME, anchor=second).ok
    assert oct((state / KEY_EVENTS_DIRNAME).stat().st_mode & 0o777) == "0o700"


async def test_a_backup_with_the_daemon_up_is_recorded_and_both_logs_verify(
    custody_state: tuple[TokenConfig, Path], tmp_path: Path
) -> None:
    """The daemon holds its audit directory's lock; the key-event log is another one."""
    token, state = custody_state
    agent = await setup_state(token, state, [str(uuid.uuid4())])
    with tempfile.TemporaryDirectory(prefix="bb-keys-") as short:  # a short socket path
        socket = Path(short) / "b.sock"
        config = write_config(Path(short) / "broker.toml", token=token, state_dir=state,
                              socket=socket, relay_url="ws://127.0.0.1:9")
        daemon = await DaemonProcess.start(config, socket)
        try:
            out = tmp_path / "up.age"
            backup = subprocess.run(
                [str(BUZZ_BROKER), "--config", str(config), "keys", "backup", "--recipient",
                 age_identity(tmp_path / "identity.txt"), "--out", str(out)],
                capture_output=True, text=True, timeout=60)
            assert backup.returncode == 0, backup.stderr
            checked = _verify(config)
            assert await daemon.stop() == 0
        finally:
            daemon.kill()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "audit log: ok " in checked.stdout and "key-event log: ok 2 records" in checked.stdout
    done = events_of(state)[-1]
    assert (done["stage"], done["pubkeys"]) == ("done", [agent.agent])


@pytest.mark.token_independent
def test_an_outcome_the_disk_refused_once_is_never_followed_by_a_failed_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`done` was called: the command did what it did. If its DONE line cannot be written,
    the command fails saying so, and no FAILED line is written after it (the log would
    say a finished rotation failed): the intent without an outcome is the one to look at."""
    state = tmp_path / "state"
    write = key_events.write
    refused: list[str] = []

    def done_refused_once(where: Path, events: object, **kwargs: object) -> object:
        stages = [e.stage for e in events]  # type: ignore[attr-defined]
        if KeyStage.DONE in stages and not refused:
            refused.append("done")
            raise AuditUnavailable("EIO key-events", busy=False)
        return write(where, events, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(key_events, "write", done_refused_once)
    with pytest.raises(CliError, match="cannot write the key-event log"):
        with recorded(state, KeyAction.BACKUP, recipients=(RECIPIENT,)) as trail:
            trail.done(agents=1)
    assert refused == ["done"]
    assert [e["stage"] for e in events_of(state)] == ["intent"]


@pytest.mark.token_independent
@pytest.mark.parametrize("raised", [KeyboardInterrupt(), RuntimeError("a-secret-in-the-text")])
def test_a_command_stopped_by_anything_else_writes_failed_naming_only_the_type(
        tmp_path: Path, raised: BaseException) -> None:
    """^C, or an exception nothing named, leaving the block: a FAILED line still follows
    the intent, its fault the exception's type name only (its text could carry a secret)."""
    state = tmp_path / "state"
    with pytest.raises(type(raised)):
        with recorded(state, KeyAction.BACKUP, recipients=(RECIPIENT,)):
            raise raised
    intent, failed = events_of(state)
    assert (intent["stage"], failed["stage"]) == ("intent", "failed")
    assert failed["fault"] == f"stopped by {type(raised).__name__}"
    assert b"a-secret-in-the-text" not in key_event_bytes(state)


@pytest.mark.token_independent
def test_a_fault_longer_than_a_key_event_holds_is_recorded_clipped(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with pytest.raises(CliError, match="^x{5000}$"):
        with recorded(state, KeyAction.BACKUP, recipients=(RECIPIENT,)):
            raise CliError("x" * 5000)
    intent, failed = events_of(state)
    assert failed["stage"] == "failed"
    assert failed["fault"].startswith("xxx") and failed["fault"].endswith("…")


@pytest.mark.token_independent
def test_a_failure_that_cannot_be_recorded_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    write = key_events.write

    def failed_refused(where: Path, events: object, **kwargs: object) -> object:
        if any(e.stage is KeyStage.FAILED for e in events):  # type: ignore[attr-defined]
            raise AuditUnavailable("EIO key-events")
        return write(where, events, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(key_events, "write", failed_refused)
    with pytest.raises(CliError, match="^the token said no; and its failure was not recorded"):
        with recorded(state, KeyAction.BACKUP, recipients=(RECIPIENT,)):
            raise CliError("the token said no")
