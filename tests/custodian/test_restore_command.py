"""`buzz-broker custodian FILE keys restore`: a backup restored under the custodian's uid,
from its own configuration, with the custodian stopped (docs/custodian.md, "Commands run
with the custodian stopped"; docs/install.md, "Restore").

- Beside a running custodian it refuses (the state lock) and restores nothing; without a
  terminal and without `--yes` it refuses; a wrong identity is one line, no traceback.
- With `--yes` it seals every agent into the custodian's keystore (custody's checks, the
  daemon's summary line), writes the custodian's hash-chained log, and `--names-out`
  writes the backup's names (0600, public entries only); run again, everything is
  "already held".
- The daemon's side: its own `keys restore` is refused with a pointer to this command;
  `agent import-names < NAMES` refuses a malformed file whole (nothing recorded), records
  the custodian's restore in the daemon's key-event log (`custodian-restore`: the
  backup's path and sha256, the agents restored; a stranger in the file is not), writes
  the names into the directory (seen through `agent list`, the records the custodian's),
  the log verifies, and the restored key signs through the custodian.
- Write-ahead (docs/custodian.md, "A change's lines"): the log is opened first, so one
  whose last line is not its own refuses the restore before anything is listed or
  restored; an `intent` line is on disk before anything is sealed, so a restore
  SIGKILLed on either side of the sealing keeps a line, and its rerun writes its own
  (`test_a_restore_killed_on_either_side_of_its_sealing_keeps_its_intent_line`,
  `test_a_log_whose_last_line_is_not_its_own_refuses_the_restore_before_it_restores`).
Under one uid here (the test's): nothing is separated but the processes.
"""

from __future__ import annotations

import functools
import contextlib
import hashlib
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import coincurve
import pytest
import trio

from buzzwire.nostr import verify_signed
from custody import Custody, TokenConfig, UnsignedEvent, export_backup
from custody.custodian.client import CustodianClient
from custody.custodian.messages import MAX_RECORDS
from custody._keystore import KEYSTORE_FILE, ReadIndex
from custody.custodian.verify import verify_chain
from daemon.state.key_events import KEY_EVENTS_DIRNAME
from tests.adversarial._secrets import SecretScan, key_secret
from tests.backup.test_backup import age_identity, key_event_bytes, key_events
from tests.backup.test_restore_checks import tombstones
from tests.custody._sealing import HUMAN
from tests.fixtures.broker import write_config
from tests.fixtures.custodian import CustodianProcess, write_custodian_config

REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str, stdin: str = "",
         file_size: int | None = None) -> subprocess.CompletedProcess[str]:
    """`python ARGV...`; `file_size`: its RLIMIT_FSIZE (a write past it fails, EFBIG: a
    full disk for the files it grows)."""
    env = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
    limit = None if file_size is None else functools.partial(
        resource.setrlimit, resource.RLIMIT_FSIZE, (file_size, resource.RLIM_INFINITY))
    done = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, input=stdin,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _keys(config: Path, *words: str,
          file_size: int | None = None) -> subprocess.CompletedProcess[str]:
    return _run("-m", "custody.custodian", str(config), "keys", *words, file_size=file_size)


def _cli(config: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return _run("-m", "daemon.cli", "--config", str(config), *args, stdin=stdin)


def test_restore_under_the_custodians_config_then_names_to_the_directory(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    token, source_state = custody_state
    secrets = [coincurve.PrivateKey() for _ in range(2)]
    identity = tmp_path / "backup.key"
    recipient = age_identity(identity)

    async def make_backup() -> list[str]:
        async with await Custody.open(token, source_state) as custody:
            agents = [(await custody.import_agent(bytearray(s.secret.hex().encode()),
                                                  owner=HUMAN)).pubkey for s in secrets]
            exported = await export_backup(custody, [recipient],
                                           {agents[0]: {"name": "scout", "creator": None}})
        (tmp_path / "agents.age").write_bytes(exported.ciphertext)
        return agents

    agents = trio.run(make_backup)
    backup = tmp_path / "agents.age"
    names = tmp_path / "names.jsonl"
    state = tmp_path / "custodian-state"  # the custodian's own keystore, empty so far
    socket = tmp_path / "c.sock"
    config = write_custodian_config(tmp_path / "custodian.toml", token=token, state_dir=state,
                                    socket=socket, relay_url=local_relay)
    log = state / "custodian" / "signed.jsonl"
    restore = ("restore", "--identity", str(identity), "--names-out", str(names))

    running = CustodianProcess(config, socket)
    running.start()
    try:
        busy = _keys(config, *restore, "--yes", str(backup))
        assert busy.returncode == 1 and "in use" in busy.stderr, busy.stderr
    finally:
        running.stop()
    assert not names.exists()

    unasked = _keys(config, *restore, str(backup))
    assert unasked.returncode == 1 and "no terminal to ask on; pass --yes" in unasked.stderr
    wrong = tmp_path / "other.key"
    age_identity(wrong)
    refused = _keys(config, "restore", "--identity", str(wrong), "--yes", str(backup))
    assert refused.returncode == 1 and "does not decrypt with this identity" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert not names.exists() and "restore" not in log.read_text()  # the running one made it

    done = _keys(config, *restore, "--yes", str(backup))
    assert done.returncode == 0, done.stderr
    assert "restored 2 agents; 0 already held" in done.stderr
    assert all(f"{a}  owner={HUMAN}  -  restore" in done.stdout for a in agents), done.stdout
    assert stat.S_IMODE(names.stat().st_mode) == 0o600
    digest = hashlib.sha256(backup.read_bytes()).hexdigest()
    header, *carried = [json.loads(line) for line in names.read_text().splitlines()]
    assert header == {"restore": {"file": str(backup), "sha256": digest}}
    assert sorted(carried, key=lambda e: agents.index(e["pubkey"])) == [
        {"pubkey": agents[0], "name": "scout", "creator": None, "restored": True},
        {"pubkey": agents[1], "name": None, "creator": None, "restored": True}]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert {e.get("agent") for e in lines if e["op"] == "restore"} >= set(agents)
    assert (lines[-1]["agents"], lines[-1]["held"]) == (2, 0)
    assert (lines[-1]["sha256"], lines[-1]["file"]) == (digest, str(backup))
    assert lines[0] == {**lines[0], "op": "intent", "for": "restore", "sha256": digest,
                        "agents": 2}  # on disk before anything was sealed
    assert lines[-1]["intent"] == lines[0]["seq"]
    assert verify_chain(log) == 4

    names_again = tmp_path / "names-again.jsonl"
    again = _keys(config, "restore", "--identity", str(identity), "--yes", "--names-out",
                  str(names_again), str(backup))
    assert again.returncode == 0 and "restored 0 agents; 2 already held" in again.stderr
    assert "already held" in again.stdout
    assert [json.loads(line).get("restored") for line in
            names_again.read_text().splitlines()] == [None, False, False]
    *_, nothing = [json.loads(line) for line in log.read_text().splitlines()]
    assert (nothing["op"], nothing["agents"], nothing["held"]) == ("restore", 0, 2)
    assert "intent" not in nothing  # nothing to restore: no intent line, none named

    # The daemon's side, as the pipeline's uid: no [pkcs11] needed, a state dir of its own.
    running.start()
    try:
        pipeline_state = tmp_path / "pipeline-state"
        pipeline_state.mkdir(mode=0o700)
        broker = tmp_path / "broker.toml"
        broker.write_text(
            f'[server]\nsocket = "{tmp_path / "broker.sock"}"\n'
            f'[state]\ndir = "{pipeline_state}"\n'
            f'[custody]\ncustodian_socket = "{socket}"\n[relay]\nurl = "{local_relay}"\n')
        own = _cli(broker, "keys", "restore", "--identity", str(identity), str(backup), "--yes")
        assert own.returncode == 2 and "buzz-custodian-admin keys restore" in own.stderr

        def listed() -> dict[str, str]:
            out = _cli(broker, "agent", "list", "--json")
            assert out.returncode == 0, out.stderr
            return {r["pubkey"]: r["name"] for r in map(json.loads, out.stdout.splitlines())}

        assert listed() == {agents[0]: agents[0][:12], agents[1]: agents[1][:12]}
        header = names.read_text().splitlines(keepends=True)[0]
        for text, number in (('{"pubkey": "x"}\n', 1),
                             (header + '{"pubkey": "x"}\n', 2),
                             (header.replace(digest, "f" * 63), 1),
                             (names.read_text().replace('"restored":true', '"restored":1', 1), 2)):
            bad = _cli(broker, "agent", "import-names", stdin=text)
            assert bad.returncode == 1 and f"names line {number}" in bad.stderr, bad.stderr
        assert not (pipeline_state / KEY_EVENTS_DIRNAME).exists()  # nothing was recorded

        stranger = coincurve.PrivateKey().public_key_xonly.format().hex()
        given = _cli(broker, "agent", "import-names", stdin=names.read_text() + json.dumps(
            {"pubkey": stranger, "name": "ghost", "creator": None, "restored": True}) + "\n")
        assert given.returncode == 0, given.stderr
        assert f"{stranger}: no live agent held here" in given.stderr
        assert listed() == {agents[0]: "scout", agents[1]: agents[1][:12]}
        # The daemon's trail: the custodian's restore, by the backup's path and sha256 (the
        # custodian's log says the same), the agents it sealed; not the stranger.
        events = key_events(pipeline_state)
        assert [(e["event"], e["stage"]) for e in events] == [
            ("custodian-restore", "intent"), ("custodian-restore", "done")]
        assert events[0]["op"] == events[1]["op"]
        assert all((e["file"], e["sha256"]) == (str(backup), digest) for e in events)
        assert (sorted(events[1]["pubkeys"]), events[1]["agents"], events[1]["held"]) == (
            sorted(agents), 2, 0)
        assert events[1]["uid"] == os.getuid()
        # The second run's file (nothing sealed then): recorded as held, none restored.
        assert _cli(broker, "agent", "import-names",
                    stdin=names_again.read_text()).returncode == 0
        assert [(e["agents"], e["pubkeys"], e["held"])
                for e in key_events(pipeline_state)[2:]] == [(None, [], None), (0, [], 2)]
        verified = _cli(broker, "audit", "verify")
        assert verified.returncode == 0 and "key-event log: ok 4 records" in verified.stdout, (
            verified.stdout + verified.stderr)

        async def signs() -> bool:
            client = CustodianClient(socket)
            try:
                signed = await client.sign_event(agents[1], UnsignedEvent(
                    agents[1], int(time.time()), 0, (), '{"name":"back"}'))
            finally:
                await client.aclose()
            return verify_signed(signed)

        assert trio.run(signs)
    finally:
        stderr = running.stop()

    scan = SecretScan()
    for number, secret in enumerate(secrets):
        scan.add(key_secret(f"agent {number}", secret.secret.hex()))
    leaks = scan.findings(done.stdout + done.stderr + again.stdout + again.stderr,
                          "the command's output")
    leaks += scan.findings(log.read_bytes() + names.read_bytes(), "the log and names file")
    leaks += scan.findings(key_event_bytes(pipeline_state), "the daemon's key-event log")
    leaks += scan.findings(stderr, "the custodian's stderr")
    assert not leaks, leaks


def _backup(token: TokenConfig, source_state: Path, tmp_path: Path, count: int = 2,
            name: str = "agents.age") -> tuple[list[str], Path, Path]:
    """`count` agents more in `source_state`, then a backup of every agent it holds: the
    new agents' pubkeys, the backup, its identity (made once, at tmp_path/backup.key)."""
    identity = tmp_path / "backup.key"
    recipient = age_identity(identity) if not identity.exists() else (
        subprocess.run(["age-keygen", "-y", str(identity)], capture_output=True, text=True,
                       check=True, timeout=30).stdout.strip())

    async def make_backup() -> list[str]:
        async with await Custody.open(token, source_state) as custody:
            agents = [(await custody.import_agent(
                bytearray(coincurve.PrivateKey().secret.hex().encode()), owner=HUMAN)).pubkey
                for _ in range(count)]
            exported = await export_backup(custody, [recipient], {})
        (tmp_path / name).write_bytes(exported.ciphertext)
        return agents

    return trio.run(make_backup), tmp_path / name, identity


#: The daemon's key commands a custodian's layout refuses, with arguments each would take.
_KEY_COMMANDS = {
    "init": (),
    "rotate": ("--new-kek-label", "rotated"),
    "migrate": ("--to-config", "{config}"),  # this very file: only the refusal may answer
    "restore": ("--identity", "{tmp}/id", "--yes", "{tmp}/agents.age"),
}


@pytest.mark.parametrize("command", sorted(_KEY_COMMANDS))
def test_the_daemons_key_commands_name_the_custodians_under_a_custodian(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path, command: str) -> None:
    """Under a custodian's layout the daemon's `keys init|rotate|migrate|restore` is one
    line, exit 2, naming the custodian's command, and the state directory is as it was.

    One uid here, the worst case: this configuration's [pkcs11] names a token whose PIN it
    can read, over a state directory holding an agent. Before, `init` made or checked the
    KEK (or, without the PIN, said to give this uid the PIN), and `rotate` resealed the
    keystore and wrote its lines to this state's key-event log, not the custodian's log.
    """
    token, state = custody_state

    async def hold_an_agent() -> None:
        async with await Custody.open(token, state) as custody:
            await custody.import_agent(bytearray(coincurve.PrivateKey().secret.hex().encode()),
                                       owner=HUMAN)

    trio.run(hold_an_agent)
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                          socket=tmp_path / "broker.sock", relay_url="ws://127.0.0.1:1",
                          sections={"custody": {"custodian_socket": str(tmp_path / "c.sock")}})

    def contents() -> dict[str, tuple[bytes, int]]:
        return {str(p.relative_to(state)): (p.read_bytes() if p.is_file() else b"",
                                            p.stat().st_mtime_ns) for p in state.rglob("*")}

    before = contents()
    words = [w.format(config=config, tmp=tmp_path) for w in _KEY_COMMANDS[command]]
    refused = _cli(config, "keys", command, *words)
    assert refused.returncode == 2, refused.stderr
    assert f"buzz-custodian-admin keys {command}" in refused.stderr
    assert f"(buzz-broker custodian FILE keys {command})" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not refused.stdout
    assert "pin_file" not in refused.stderr and "token-pin" not in refused.stderr
    assert contents() == before  # no key-event log, nothing resealed, nothing opened


def _restoring_custodian(token: TokenConfig, tmp_path: Path) -> tuple[Path, Path]:
    """A custodian's configuration with a keystore of its own, empty so far (no relay: a
    restore needs none): the file, and where its signed log will be."""
    state = tmp_path / "custodian-state"
    config = write_custodian_config(tmp_path / "custodian.toml", token=token, state_dir=state,
                                    socket=tmp_path / "c.sock", relay_url="ws://127.0.0.1:1")
    return config, state / "custodian" / "signed.jsonl"


def _lines(log: Path) -> list[dict[str, Any]]:
    """The log's lines, once its chain verifies whole."""
    text = log.read_text()
    assert verify_chain(log) == len(text.splitlines())
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("point", ["intent", "changed"])
def test_a_restore_killed_on_either_side_of_its_sealing_keeps_its_intent_line(
        point: str, custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    """SIGKILLed once its intent is on disk (nothing sealed yet), and once `restore_backup`
    returned (every agent sealed, no line after the intent). Before, the log was opened
    only after the sealing: either kill left no line at all, and after the second the
    rerun counted the agents "already held" and wrote no line for them, ever."""
    token, source_state = custody_state
    agents, backup, identity = _backup(token, source_state, tmp_path)
    config, log = _restoring_custodian(token, tmp_path)
    restore = ("keys", "restore", "--identity", str(identity), "--yes", str(backup))
    digest = hashlib.sha256(backup.read_bytes()).hexdigest()

    killed = subprocess.run(
        [sys.executable, "-m", "tests.custodian.crashing_custodian", str(config),
         f"restore:{point}", *restore], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert f"custodian.kill step=restore:{point}" in killed.stderr
    (intent,) = _lines(log)  # the chain verifies, and the intent is its one line
    assert {k: intent[k] for k in ("op", "for", "sha256", "agents")} == {
        "op": "intent", "for": "restore", "sha256": digest, "agents": 2}

    # The rerun: sealed by the killed run, the agents are "already held", and this run
    # changes nothing, so it writes its summary alone; killed before, it restores them
    # under an intent of its own. Either way the killed intent stands with no outcome.
    rerun = _keys(config, *restore[1:])
    assert rerun.returncode == 0, rerun.stderr
    after = _lines(log)[1:]
    assert {e.get("intent") for e in after} <= {None, *(e["seq"] for e in after)}
    *sealed, summary = after
    if point == "changed":
        assert "restored 0 agents; 2 already held" in rerun.stderr
        assert sealed == [] and "intent" not in summary
        assert (summary["agents"], summary["held"], summary["sha256"]) == (0, 2, digest)
    else:
        assert "restored 2 agents; 0 already held" in rerun.stderr
        again, *each = sealed
        assert (again["op"], again["for"], again["agents"]) == ("intent", "restore", 2)
        assert sorted(e["agent"] for e in each) == sorted(agents)
        assert (summary["agents"], summary["held"], summary["intent"]) == (2, 0, again["seq"])


def test_a_log_whose_last_line_is_not_its_own_refuses_the_restore_before_it_restores(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    """Before, the restore sealed every agent and wrote the names file, and only then
    opened the log and was refused: the agents were restored with no line."""
    token, source_state = custody_state
    _, backup, identity = _backup(token, source_state, tmp_path)
    config, log = _restoring_custodian(token, tmp_path)
    log.parent.mkdir(parents=True, mode=0o700)
    log.write_text('{"op": "restore"}\n')  # no seq, no hash: no line of this log
    names = tmp_path / "names.jsonl"
    restore = ("restore", "--identity", str(identity), "--yes", "--names-out", str(names),
               str(backup))

    refused = _keys(config, *restore)
    assert refused.returncode == 1
    opened, fault = refused.stderr.splitlines()  # custody's own info line, then the fault
    assert opened.startswith("custodian: custody open: ")
    assert "its last line is not a line of this log" in fault
    assert refused.stdout == "" and not names.exists()  # nothing listed, nothing written
    assert log.read_text() == '{"op": "restore"}\n'

    log.rename(log.with_name("set-aside.jsonl"))  # as the line says: nothing was restored
    done = _keys(config, *restore)
    assert done.returncode == 0 and "restored 2 agents; 0 already held" in done.stderr


def test_a_restore_the_keystore_cannot_take_has_its_failed_line(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    """The keystore's write fails partway (the file-size limit, as a full disk): the intent
    stands, then `failed` naming it and the fault's type; the operator is told the fault
    itself. Run again without the limit, it restores the rest. Before, nothing was written:
    the agents sealed before the fault had no line, and the rerun held them unsaid."""
    token, source_state = custody_state
    _, first, identity = _backup(token, source_state, tmp_path)
    _, more, _ = _backup(token, source_state, tmp_path, 20, "more.age")  # 22 agents
    config, log = _restoring_custodian(token, tmp_path)
    assert _keys(config, "restore", "--identity", str(identity), "--yes",
                 str(first)).returncode == 0  # the keystore made, and two agents in it
    before = len(_lines(log))

    # 32 KiB: the keystore's WAL index (-shm) is made that size at open, the log stays far
    # below it, and the WAL outgrows it within the first commits (each a 4 KiB page or more).
    failed = _keys(config, "restore", "--identity", str(identity), "--yes", str(more),
                   file_size=32 * 1024)
    assert failed.returncode == 1 and "keystore write failed" in failed.stderr, failed.stderr
    intent, fault = _lines(log)[before:]
    assert (intent["op"], intent["for"], intent["agents"]) == ("intent", "restore", 20)
    assert fault == {**fault, "op": "failed", "intent": intent["seq"], "fault": "CustodyError"}

    rerun = _keys(config, "restore", "--identity", str(identity), "--yes", str(more))
    assert rerun.returncode == 0, rerun.stderr
    *_, summary = _lines(log)
    assert summary["agents"] + summary["held"] == 22 and summary["held"] >= 2


def test_a_restore_past_max_records_is_one_line_and_writes_nothing(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    """A restore that would take the custodian's keystore past MAX_RECORDS (its `agents`
    answer's one frame) is refused before its intent line, its names file or any agent:
    one line naming the counts and `--forget-destroyed`. Before, it sealed them all."""
    token, source_state = custody_state
    _, first, identity = _backup(token, source_state, tmp_path)
    _, more, _ = _backup(token, source_state, tmp_path, 2, "more.age")  # 2 agents new to it
    config, log = _restoring_custodian(token, tmp_path)
    assert _keys(config, "restore", "--identity", str(identity), "--yes",
                 str(first)).returncode == 0  # the keystore made, and two agents in it
    keystore = tmp_path / "custodian-state" / KEYSTORE_FILE
    tombstones(keystore, MAX_RECORDS - 3)
    before, names = log.read_text(), tmp_path / "names.jsonl"

    refused = _keys(config, "restore", "--identity", str(identity), "--yes",
                    "--names-out", str(names), str(more))
    assert refused.returncode == 1 and refused.stdout == ""
    fault = refused.stderr.splitlines()[-1]
    assert f"holds {MAX_RECORDS - 1} records" in fault and "adds 2" in fault, fault
    assert "--forget-destroyed" in fault and fault.endswith("nothing restored")
    assert log.read_text() == before and not names.exists()
    index = ReadIndex(keystore)
    try:
        assert index.count() == MAX_RECORDS - 1
    finally:
        index.close()


def test_a_names_file_the_disk_cannot_take_is_one_line_after_the_lines(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    """`--names-out` on a full filesystem (a real one: a tmpfs filled to its last byte):
    the restore is done and its lines are in the log, so the fault is one line saying
    so, and no torn names file is left. Before, the names were written first: the write
    raised a traceback and the restore's lines were never written."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    token, source_state = custody_state
    agents, backup, identity = _backup(token, source_state, tmp_path)
    config, log = _restoring_custodian(token, tmp_path)
    full = tmp_path / "full"
    full.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(full)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        with open(full / "filler", "wb", buffering=0) as out:
            with contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * 4096)
        names = full / "names.jsonl"
        done = _keys(config, "restore", "--identity", str(identity), "--yes",
                     "--names-out", str(names), str(backup))
        assert not names.exists()
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)
    assert done.returncode == 1
    fault = done.stderr.strip().splitlines()[-1]
    assert "cannot write --names-out" in fault and "the restore is done" in fault, done.stderr
    intent, *each, summary = _lines(log)
    assert (intent["op"], summary["intent"]) == ("intent", intent["seq"])
    assert sorted(e["agent"] for e in each) == sorted(agents)


def test_restore_usage_lines(tmp_path: Path) -> None:
    config = tmp_path / "custodian.toml"
    config.write_text('[custodian]\nsocket = "s"\nstate_dir = "st"\nrelay_url = "ws://x"\n'
                      '[pkcs11]\nmodule = "/nonexistent.so"\ntoken_label = "t"\n')
    for words in (("restore",), ("restore", "b.age"), ("restore", "--identity", "id"),
                  ("restore", "--identity", "id", "--identity", "id2", "b.age"),
                  ("restore", "--identity", "id", "--out", "x", "b.age")):
        done = _keys(config, *words)
        assert done.returncode == 2 and "usage" in done.stderr, (words, done.stderr)


def test_the_options_each_refusal_names_are_the_custodians_own() -> None:
    """The refusals spell the custodian's command with its options (daemon/cli/keys.py
    `CUSTODIAN_COMMANDS`); the custodian parses them from its own tables
    (custody/custodian/keys.py). Every option a refusal names is one its command takes,
    so a renamed option fails here, not in an operator's terminal."""
    from custody.custodian import keys as custodians
    from daemon.cli.keys import CUSTODIAN_COMMANDS

    assert set(CUSTODIAN_COMMANDS) == set(custodians._OPTIONS)
    for command, (_what, words, _after) in CUSTODIAN_COMMANDS.items():
        named = {w.strip("[]") for w in words.split() if w.strip("[]").startswith("--")}
        takes = {*custodians._OPTIONS[command], *custodians._FLAGS.get(command, ())}
        assert words.split()[0] == command and named <= takes, (command, named - takes)
        assert set(custodians._REQUIRED.get(command, ())) <= named, command
