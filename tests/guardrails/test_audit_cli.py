"""`buzz-broker audit verify|show` as an operator runs them: a subprocess, stdout, exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from daemon.state.audit import AuditLog, audit_files
from daemon.cli import EXIT_CLOSED_PIPE
from daemon.cli._common import EXIT_USAGE
from daemon.cli.audit import EXIT_BROKEN

from .test_audit import AGENT, record

OTHER = "cd" * 32
#: Lines the version before body MACs wrote (`bodySha256`); vectors/README.md says how.
OLD_LOG = Path(__file__).parent / "vectors" / "audit_before_body_mac.jsonl"


def buzz(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BUZZ_BROKER_CONFIG"}
    return subprocess.run([sys.executable, "-m", "daemon.cli", *argv], capture_output=True,
                          text=True, timeout=60, env=env)


async def make_log(state: Path) -> None:
    log = AuditLog.open(state / "audit", rotate_bytes=4096)
    now = time.time()
    for i in range(30):
        r = record(i, agent=AGENT if i % 3 else OTHER,
                   action="channel.read" if i % 5 == 0 else "message.post")
        # Spread over the last 30 hours: record i is (30 - i) hours old.
        await log.append(r.__class__(**{**{f: getattr(r, f) for f in r.__dataclass_fields__},
                                        "at": now - (30 - i) * 3600}))
    await log.aclose()


def test_verify_and_show(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    trio.run(make_log, state)
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')

    # Default path: the configured state directory's audit directory.
    ok = buzz("--config", str(config), "audit", "verify")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("audit log: ok 30 records; head ")
    head = ok.stdout.split()[-1]

    table = buzz("--config", str(config), "audit", "show", "--agent", AGENT.upper(),
                 "--since", "12h")
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()
    assert rows[0].startswith("TIME (UTC)")
    # Records 18..29 are under 12 h old; those with i % 3 != 0 belong to AGENT.
    assert len(rows) - 1 == len([i for i in range(18, 30) if i % 3])

    as_json = buzz("audit", "show", "--path", str(state / "audit"), "--json",
                   "--action", "channel.read", "--until", "1h")
    lines = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [o["requestId"] for o in lines] == [f"req-{i:05d}" for i in range(0, 30, 5)]

    # Tamper with one record: verify names the file and line and exits EXIT_BROKEN.
    second = audit_files(state / "audit")[1][1]
    text = second.read_bytes().splitlines(keepends=True)
    second.write_bytes(b"".join(text[:1] + text[2:]))
    broken = buzz("--config", str(config), "audit", "verify", str(state / "audit"))
    assert broken.returncode == EXIT_BROKEN
    assert broken.stdout.startswith(f"broken: {second.name} line 2: ")

    restored = b"".join(text)
    second.write_bytes(restored)
    assert buzz("audit", "verify", str(state / "audit"), "--head", head).returncode == 0
    assert buzz("audit", "verify", str(state / "audit"), "--head", f"30:{'0' * 64}"
                ).returncode == EXIT_BROKEN

    # Faults are one line, no traceback: 1 for a path with no log, 2 for a malformed filter.
    for argv, code in ((("audit", "verify", str(tmp_path / "nothing")), 1),
                       (("audit", "show", "--path", str(state / "audit"), "--since",
                         "yesterday"), 2),
                       (("audit", "show", "--path", str(state / "audit"), "--agent", "xyz"), 2)):
        fault = buzz(*argv)
        assert fault.returncode == code, (argv, fault.stderr)
        assert fault.stderr.count("\n") == 1 and "Traceback" not in fault.stderr


def _answer_on_a_terminal(argv: list[str], answer: bytes) -> tuple[int, str]:
    """Run `buzz-broker argv` with a terminal for stdin, typing `answer`; (status, output)."""
    import pty

    main_fd, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "BUZZ_BROKER_CONFIG"}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", *argv], stdin=terminal,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        os.write(main_fd, answer)
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(main_fd)
        os.close(terminal)
    return proc.returncode, out.decode()


def test_reanchor_asks_and_is_itself_audited(tmp_path: Path) -> None:
    from daemon.state.audit import Reanchor, read_records, verify
    from daemon.state.ledger import read_anchor, write_anchor

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    trio.run(make_log, state)
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    whole = verify(state / "audit")
    # The anchor a restored disk no longer reaches: two records further than the log.
    write_anchor(state / "ledger.db", (whole.records + 2, "ef" * 32))
    assert buzz("--config", str(config), "audit", "verify").returncode == EXIT_BROKEN

    status, out = _answer_on_a_terminal(["--config", str(config), "audit", "reanchor"], b"n\n")
    assert status == 1 and "not re-anchored" in out
    assert read_anchor(state / "ledger.db") == (whole.records + 2, "ef" * 32)

    status, out = _answer_on_a_terminal(["--config", str(config), "audit", "reanchor"], b"y\n")
    assert status == 0 and "re-anchored at record 31" in out, out
    assert buzz("--config", str(config), "audit", "verify").returncode == 0
    last = list(read_records(state / "audit"))[-1].record
    assert isinstance(last, Reanchor) and last.anchored_seq == whole.records + 2
    assert last.anchored_head == "ef" * 32 and last.uid == os.getuid()
    assert read_anchor(state / "ledger.db") == (31, verify(state / "audit").head)


@pytest.mark.parametrize("form", [(), ("--json",)], ids=["table", "json"])
def test_a_reader_that_went_away_ends_the_output_quietly(tmp_path: Path,
                                                          form: tuple[str, ...]) -> None:
    """`audit show | head`: the reader is gone before the first write. Before, the table
    form said "internal error (BrokenPipeError)" and exited 70, the JSON form "cannot read
    …: Broken pipe"; a pipeline wants nothing on stderr and the shell's 141."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    trio.run(make_log, state)
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "BUZZ_BROKER_CONFIG"}
    try:
        done = subprocess.run([sys.executable, "-m", "daemon.cli", "audit", "show", "--path",
                               str(state / "audit"), *form], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60, env=env)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (EXIT_CLOSED_PIPE, "")


def test_a_broken_pipe_elsewhere_is_not_a_closed_stdout(tmp_path: Path) -> None:
    """Only standard output's own reader going away is quiet: with stdout open, a command
    fault is still its one line (here: no audit directory)."""
    done = buzz("audit", "show", "--path", str(tmp_path / "none"))
    assert done.returncode == 1 and done.stderr.startswith("buzz-broker: ")


def test_a_remembered_head_still_verifies_after_the_log_has_grown(tmp_path: Path) -> None:
    """`--head SEQ:HASH` is a consistency check: a head printed earlier, the log grown
    since, passes; a rewrite at or before it, or a cut before it, does not. Before, a head
    printed minutes earlier on a running daemon was reported as "records were removed from
    the end" (that strict check is `--ends-at` now)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    trio.run(make_log, state)
    log = state / "audit"
    first = buzz("audit", "verify", str(log))
    assert first.returncode == 0, first.stderr
    remembered = first.stdout.split()[-1]
    seq, digest = remembered.split(":")
    assert seq == "30" and len(digest) == 64

    async def grow() -> None:
        more = AuditLog.open(log, rotate_bytes=4096)
        for i in range(30, 40):
            await more.append(record(i, agent=AGENT))
        await more.aclose()

    trio.run(grow)
    grown = buzz("audit", "verify", str(log), "--head", remembered)
    assert grown.returncode == 0, grown.stdout + grown.stderr
    assert "ok 40 records; head 40:" in grown.stdout
    assert "holds the head given (record 30)" in grown.stdout
    assert buzz("audit", "verify", str(log), "--ends-at", digest).returncode == EXIT_BROKEN
    assert buzz("audit", "verify", str(log), "--head", f"31:{digest}").returncode == EXIT_BROKEN
    ahead = buzz("audit", "verify", str(log), "--head", f"41:{digest}")
    assert ahead.returncode == EXIT_BROKEN and "the head given is record 41" in ahead.stdout

    # Records cut back to before the remembered head: reported as cut, not as consistent.
    files = audit_files(log)
    kept, cut = 0, False
    for _number, file in files:
        lines = file.read_bytes().splitlines(keepends=True)
        if cut:
            file.unlink()
        elif kept + len(lines) >= 20:
            file.write_bytes(b"".join(lines[:20 - kept]))
            cut = True
        else:
            kept += len(lines)
    shorter = buzz("audit", "verify", str(log), "--head", remembered)
    assert shorter.returncode == EXIT_BROKEN
    assert "the log ends at record 20 but the head given is record 30" in shorter.stdout
    # A bare hash for --head is a usage error that names the form and --ends-at.
    bare = buzz("audit", "verify", str(log), "--head", digest)
    assert bare.returncode == 2 and "--ends-at" in bare.stderr


def test_a_log_begun_before_body_macs_continues_verifies_and_shows(tmp_path: Path) -> None:
    """A log spans upgrades: the daemon continues a chain whose lines name their body by
    `bodySha256`, writes its own with `bodyMac`, and `verify`, `show` and `show --json`
    read both (docs/operations.md, "Fields")."""
    import dataclasses
    import shutil

    from daemon.state.audit import AuditRecord, BodyDigest, BodyKind, read_records
    from daemon.state.audit_mac import BodyMac

    state = tmp_path / "state"
    (state / "audit").mkdir(parents=True, mode=0o700)
    shutil.copyfile(OLD_LOG, state / "audit" / "audit-000001.jsonl")
    before = buzz("audit", "verify", str(state / "audit"))
    assert before.returncode == 0 and before.stdout.startswith("ok 4 records; head 4:"), before
    old_head = before.stdout.split()[-1]

    async def upgraded() -> None:
        log = AuditLog.open(state / "audit")  # reads the old tail back and chains on from it
        body_mac = BodyMac.open(state)
        for i in range(3):
            await log.append(dataclasses.replace(
                record(i), body=BodyDigest.mac(body_mac.of(b"body %d" % i))))
        await log.aclose()

    trio.run(upgraded)
    log = state / "audit"
    ok = buzz("audit", "verify", str(log), "--head", old_head)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("ok 7 records; head 7:")

    shown = buzz("audit", "show", "--path", str(log), "--json")
    assert (shown.returncode, shown.stderr) == (0, "")
    assert shown.stdout == (log / "audit-000001.jsonl").read_text()  # the stored lines
    members = [sorted({"bodyMac", "bodySha256"} & set(json.loads(line)))
               for line in shown.stdout.splitlines()]
    assert members == [["bodySha256"], ["bodySha256"], [], ["bodySha256"],
                       ["bodyMac"], ["bodyMac"], ["bodyMac"]]

    table = buzz("audit", "show", "--path", str(log))
    assert (table.returncode, table.stderr) == (0, "")
    rows = table.stdout.splitlines()[1:]
    assert [row.split()[2] for row in rows] == [
        "intent", "verdict", "refusals", "verdict", "verdict", "verdict", "verdict"]
    assert [row.split()[6] for row in rows] == [
        "old-put-1", "old-post-2", "3", "old-put-1", "req-00000", "req-00001", "req-00002"]

    kinds = [entry.record.body.kind for entry in read_records(log)
             if isinstance(entry.record, AuditRecord)]
    assert kinds == [BodyKind.SHA256] * 3 + [BodyKind.MAC] * 3



def test_a_head_given_for_a_missing_audit_log_is_broken(tmp_path: Path) -> None:
    """The key-event log present, the audit log gone (deleted by whoever cut it): the head
    the operator remembered cannot be held, so `--head`/`--ends-at` report it broken.
    Before, "none at … (the daemon has not run here)" and exit 0: the cut passed."""
    from daemon.cli._key_trail import recorded
    from daemon.state.audit import KeyAction

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with recorded(state, KeyAction.CUSTODIAN_RESTORE, file="agents.age",
                  sha256="ab" * 32) as trail:
        trail.done(agents=0, pubkeys=(), held=0)
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    plain = buzz("--config", str(config), "audit", "verify")
    assert plain.returncode == 0 and "audit log: none at" in plain.stdout, plain.stdout
    for remembered in (["--head", "30:" + "0f" * 32], ["--ends-at", "0f" * 32]):
        done = buzz("--config", str(config), "audit", "verify", *remembered)
        assert done.returncode == EXIT_BROKEN, done.stdout + done.stderr
        assert "audit log: broken:" in done.stdout and "the head given" in done.stdout
        assert "key-event log: ok" in done.stdout


@pytest.mark.parametrize("argv", [["show", "--path"], ["verify"]], ids=["show", "verify"])
def test_a_path_too_long_for_the_system_is_one_line(argv: list[str], tmp_path: Path) -> None:
    done = buzz("audit", *argv, str(tmp_path / ("x" * 300)))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("buzz-broker: cannot use "), lines
    assert "File name too long" in lines[0]


def test_a_path_without_the_daemons_audit_files_is_a_fault_not_a_verdict(
        tmp_path: Path) -> None:
    """`audit verify PATH` where PATH holds no audit file said "ok 0 records", exit 0: an
    auditor checking an archive copy that failed got a pass. Pointed at the custodian's
    log (written here by its own writer) it said "broken: ... not in canonical form (the
    line was edited)", exit 3: a false tamper alarm. Each is now one line, exit 1, saying
    what it looks for, and naming the custodian's own command for its log."""
    from custody.custodian.ledger import SignLog

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    trio.run(make_log, state)
    log_dir = tmp_path / "custodian"
    log_dir.mkdir(mode=0o700)
    custodians = SignLog(log_dir / "signed.jsonl", 1 << 20)
    custodians.append([{"op": "mint", "agent": AGENT}, {"op": "sign", "agent": AGENT,
                                                        "kind": 1, "id": "ab" * 32}])
    custodians.close()
    empty = tmp_path / "copy-that-failed"
    empty.mkdir()
    renamed = tmp_path / "audit-copy.jsonl"
    renamed.write_bytes(audit_files(state / "audit")[0][1].read_bytes())

    for path, says in ((empty, "no audit files"), (state, "no audit files"),
                       (log_dir, "no audit files"),
                       (log_dir / "signed.jsonl", "is not an audit file by its name"),
                       (renamed, "is not an audit file by its name")):
        done = buzz("audit", "verify", str(path))
        assert done.returncode == 1, (path, done.stdout, done.stderr)
        assert done.stdout == "" and "broken" not in done.stderr, done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("buzz-broker: "), lines
        assert says in lines[0] and "audit-NNNNNN.jsonl" in lines[0], lines[0]
        assert "buzz-broker custodian FILE --verify-log" in lines[0], lines[0]
    # Controls: the daemon's own logs by the same command, a directory and one file.
    assert buzz("audit", "verify", str(state / "audit")).returncode == 0
    first = audit_files(state / "audit")[0][1]
    assert buzz("audit", "verify", str(first)).returncode == 0


def test_a_damaged_key_event_anchor_is_broken_not_an_internal_error(tmp_path: Path) -> None:
    """`key-events.head` edited into something that is not one `seq sha256` line: verify
    says the key-event log is broken (exit EXIT_BROKEN), one line, no traceback."""
    from daemon.cli._key_trail import recorded
    from daemon.state.audit import KeyAction
    from daemon.state.key_events import HEAD_FILE

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with recorded(state, KeyAction.CUSTODIAN_RESTORE, file="agents.age",
                  sha256="ab" * 32) as trail:
        trail.done(agents=0, pubkeys=(), held=0)
    (state / HEAD_FILE).write_text("1 not-a-hash\n")
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    done = buzz("--config", str(config), "audit", "verify")
    assert done.returncode == EXIT_BROKEN, done.stdout + done.stderr
    assert "key-event log: broken:" in done.stdout and "damaged or edited" in done.stdout
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr


def test_reanchor_refuses_a_log_that_does_not_verify_on_its_own(tmp_path: Path) -> None:
    """Re-anchoring accepts a log cut short by a restore, never an edited one: a log whose
    own chain is broken is refused, nothing appended, the anchor kept."""
    from daemon.state.ledger import read_anchor, write_anchor

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    trio.run(make_log, state)
    first = audit_files(state / "audit")[0][1]
    text = first.read_text()
    assert "message.post" in text
    first.write_text(text.replace("message.post", "message.pots", 1))  # an edit
    write_anchor(state / "ledger.db", (99, "ef" * 32))
    before = [p.read_bytes() for _, p in audit_files(state / "audit")]
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    done = buzz("--config", str(config), "audit", "reanchor", "--yes")
    assert done.returncode == 1 and "the audit log itself is broken" in done.stderr, (
        done.stdout + done.stderr)
    assert read_anchor(state / "ledger.db") == (99, "ef" * 32)
    assert [p.read_bytes() for _, p in audit_files(state / "audit")] == before


def test_an_audit_directory_that_is_a_symlink_is_broken(tmp_path: Path) -> None:
    """`<state>/audit` replaced by a link to another chain is not the daemon's log."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    trio.run(make_log, elsewhere)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "audit").symlink_to(elsewhere / "audit")
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    done = buzz("--config", str(config), "audit", "verify")
    assert done.returncode == EXIT_BROKEN, done.stdout + done.stderr
    assert "audit log: broken:" in done.stdout


def test_reanchor_of_a_log_that_reaches_its_anchor_changes_nothing(tmp_path: Path) -> None:
    from daemon.state.audit import verify
    from daemon.state.ledger import read_anchor, write_anchor

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    trio.run(make_log, state)
    whole = verify(state / "audit")
    write_anchor(state / "ledger.db", (whole.seq, whole.head))
    before = [p.read_bytes() for _, p in audit_files(state / "audit")]
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    done = buzz("--config", str(config), "audit", "reanchor", "--yes")
    assert done.returncode == 0 and "nothing to do" in done.stdout, done.stdout + done.stderr
    assert [p.read_bytes() for _, p in audit_files(state / "audit")] == before
    assert read_anchor(state / "ledger.db") == (whole.seq, whole.head)


def test_a_remembered_head_in_upper_case_hex_is_the_same_head(tmp_path: Path) -> None:
    """`--head`/`--ends-at` take 64 hex of either case (a hash pasted from another tool):
    the same head, compared as the log prints it."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    trio.run(make_log, state)
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    seq, head = buzz("--config", str(config), "audit", "verify").stdout.split()[-1].split(":")
    for given in (["--head", f"{seq}:{head.upper()}"], ["--ends-at", head.upper()]):
        done = buzz("--config", str(config), "audit", "verify", *given)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_broken_chain_exits_3_as_documented(tmp_path: Path) -> None:
    """docs/operations.md: `audit verify` "exits 3 when a chain is broken" (scripts test
    for 3; 1 is a fault, 2 a usage error)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    trio.run(make_log, state)
    first = audit_files(state / "audit")[0][1]
    first.write_text(first.read_text().replace("message.post", "message.pots", 1))
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    done = buzz("--config", str(config), "audit", "verify")
    assert done.returncode == 3 and "audit log: broken:" in done.stdout, done.stdout


def test_a_time_without_a_zone_is_utc_whatever_the_local_zone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    from daemon.cli.audit import parse_time

    monkeypatch.setenv("TZ", "XST-5:30")  # a POSIX zone string: no tzdata needed
    time.tzset()
    try:
        assert parse_time("2026-11-30T15:00:00", 0.0) == datetime.datetime(
            2026, 11, 30, 15, tzinfo=datetime.timezone.utc).timestamp()
    finally:
        monkeypatch.undo()
        time.tzset()


def test_verify_where_there_is_no_log_of_either_kind_is_a_fault_not_ok(tmp_path: Path) -> None:
    """No audit log, no key-event log, no anchor: a state directory the daemon never used
    (a mistyped `[state] dir`, another host's config) is "no audit log at …", exit 1, never
    "ok"-like exit 0. "none at … (the daemon has not run here)" is only said beside a
    key-event log."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    done = buzz("--config", str(config), "audit", "verify")
    assert done.returncode == 1 and "no audit log at" in done.stderr, done.stdout + done.stderr


@pytest.mark.parametrize(("flag", "value", "allowed"), [
    ("--credential", "cred_XYZ", "cred_ followed by 16 hex"),
    ("--credential", "0123456789abcdef", "cred_ followed by 16 hex"),
    ("--credential", "cred_0123456789ABCDEF", "cred_ followed by 16 hex"),
    ("--action", "message.pots", "message.post"),
    ("--action", "keys.backup", "channel.read"),
    ("--action", "", "liveness.ping"),
])
def test_a_malformed_credential_or_action_filter_is_a_usage_line(
        tmp_path: Path, flag: str, value: str, allowed: str) -> None:
    """Before, `show --credential`/`--action` took any word and matched nothing, exit 0: a
    typo read as "no such records". The credential id's shape is the one the daemon issues
    (daemon/state/sessions.py), the actions the contract's table: refused before any path."""
    done = buzz("audit", "show", "--path", str(tmp_path / "nothing"), flag, value)
    assert (done.returncode, done.stdout) == (EXIT_USAGE, ""), (done.returncode, done.stderr)
    [line] = done.stderr.splitlines()
    assert line.startswith(f"buzz-broker: {flag}: ") and allowed in line, line


def test_a_well_formed_filter_that_matches_nothing_is_an_empty_table(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    trio.run(make_log, state)
    for flag, value in (("--credential", "cred_" + "f" * 16), ("--action", "typing.set")):
        done = buzz("audit", "show", "--path", str(state / "audit"), flag, value)
        assert (done.returncode, done.stderr) == (0, ""), (flag, done.stderr)
        assert done.stdout.splitlines()[1:] == [], done.stdout


def test_an_action_filter_that_is_no_action_is_not_echoed(tmp_path: Path) -> None:
    """A credential pasted into `--action` by mistake must not be printed back: only a
    value of an action's shape is quoted in the refusal."""
    token = "bzb_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789EFGH"
    done = buzz("audit", "show", "--path", str(tmp_path / "nothing"), "--action", token)
    assert done.returncode == EXIT_USAGE and "(not shown)" in done.stderr, done.stderr
    assert "AbCd" not in done.stdout + done.stderr
    shaped = buzz("audit", "show", "--path", str(tmp_path / "nothing"), "--action", "message.pots")
    assert "'message.pots'" in shaped.stderr, shaped.stderr
