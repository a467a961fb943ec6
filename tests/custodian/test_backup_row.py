"""Backup with the daemon up, as a row of the custodian's table (custody/custodian/backup.py).

- `buzz-broker keys backup` with `[custody] custodian_socket` asks the custodian: the
  file is written into the custodian's `[backup] dir`, encrypted to its `[backup]
  recipients` only, carries the directory's names, is named in the operator's key-event
  log and the custodian's own log, and restores with `keys restore` (and opens with
  `open_backup`). The daemon's config there names a state directory with no keystore,
  as under two uids: `agent list` and `status` list the custodian's agents all the same.
- The row has no member for recipients or a path: asked straight over the socket with
  one, the custodian answers `bad_message`; without `[backup]` configured, `refused`;
  the command refuses `--recipient` and `--out` when a custodian holds the keys.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import coincurve
import pytest

from custody import TokenConfig, open_backup
from custody.custodian.client import CustodianClient
from custody.custodian.config import ConfigError, load
from custody.custodian.verify import verify_chain
from daemon.state.directory import AgentDirectory
from tests.adversarial._secrets import SecretScan, key_secret
from tests.backup.test_backup import age_identity, key_event_bytes, key_events
from tests.custodian.test_refusals import ask, human
from tests.fixtures.broker import write_config
from tests.fixtures.custodian import CustodianProcess, running_custodian, write_custodian_config
from tests.fixtures.token import REPO

BUZZ_BROKER = REPO / ".venv" / "bin" / "buzz-broker"


@pytest.fixture
def identity(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "backup.key"
    return path, age_identity(path)


@pytest.fixture
def backing_custodian(custody_state: tuple[TokenConfig, Path], local_relay: str,
                      tmp_path: Path, identity: tuple[Path, str]) -> Iterator[CustodianProcess]:
    token, state_dir = custody_state
    socket = tmp_path / "custodian.sock"
    config = write_custodian_config(
        tmp_path / "custodian.toml", token=token, state_dir=state_dir, socket=socket,
        relay_url=local_relay,
        backup={"recipients": [identity[1]], "dir": str(tmp_path / "backups")})
    process = CustodianProcess(config, socket)
    process.start()
    yield process
    process.stop()


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(BUZZ_BROKER), "--config", str(config), *args],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert "Traceback" not in done.stderr
    return done


async def test_keys_backup_asks_the_custodian_and_the_file_restores(
        backing_custodian: CustodianProcess, custody_state: tuple[TokenConfig, Path],
        local_relay: str, tmp_path: Path, identity: tuple[Path, str]) -> None:
    token, state_dir = custody_state
    client = CustodianClient(backing_custodian.socket)
    secrets = [coincurve.PrivateKey() for _ in range(2)]
    agents = [(await client.import_agent(bytearray(s.secret.hex().encode()),
                                         owner=human())).pubkey for s in secrets]
    # The pipeline's own state directory, as under two uids: no keystore in it, so what
    # the commands list and back up comes through the custodian's record lookups.
    pipeline_state = tmp_path / "pipeline-state"
    pipeline_state.mkdir(mode=0o700)
    directory = AgentDirectory.open(pipeline_state, client.records)
    directory.enroll(agents[0], "scout")
    directory.close()
    await client.aclose()
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=pipeline_state,
                          socket=tmp_path / "b.sock", relay_url=local_relay,
                          sections={"custody": {"custodian_socket":
                                                str(backing_custodian.socket)}})
    listed = [json.loads(line) for line in _cli(config, "agent", "list", "--json").stdout.splitlines()]
    assert {r["pubkey"]: r["name"] for r in listed} == {agents[0]: "scout",
                                                        agents[1]: agents[1][:12]}
    status = json.loads(_cli(config, "status", "--json").stdout.splitlines()[0])
    assert status["agents"]["detail"] == "2 live, 0 deleted", status["agents"]

    refused = _cli(config, "keys", "backup", "--recipient", identity[1],
                   "--out", str(tmp_path / "mine.age"))
    assert refused.returncode == 2 and "drop --recipient and --out" in refused.stderr
    assert not (tmp_path / "mine.age").exists()

    done = _cli(config, "keys", "backup")
    assert done.returncode == 0, done.stderr
    files = list((tmp_path / "backups").iterdir())
    assert len(files) == 1 and files[0].name.startswith("agents-")
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert f"backed up 2 agents to {files[0]}" in done.stdout

    # The operator's key-event log: intent, then the custodian's file and recipients.
    lines = [e for e in key_events(pipeline_state) if e["event"] == "backup"]
    assert [e["stage"] for e in lines] == ["intent", "done"]
    assert lines[1]["file"] == str(files[0]) and lines[1]["recipients"] == [identity[1]]
    assert set(lines[1]["pubkeys"]) == set(agents)  # type: ignore[arg-type]
    assert lines[1]["sha256"] in done.stdout
    # The custodian's own log names it too, and its chain holds.
    log = backing_custodian.config.parent / "state" / "custodian" / "signed.jsonl"
    assert verify_chain(log) > 0
    assert any(json.loads(line).get("op") == "backup" for line in log.read_text().splitlines())

    # It opens with the identity, every check passed, the names carried.
    with open_backup(files[0].read_bytes(), bytearray(identity[0].read_bytes())) as contents:
        assert {r.pubkey for r in contents.records} == set(agents)
        assert contents.public(agents[0])["name"] == "scout"
    # And the operator's restore command takes it: decrypts, checks, lists, seals (here in
    # the pipeline's directory, a keystore of its own: the restore runs in process).
    restore_config = write_config(tmp_path / "restore.toml", token=token,
                                  state_dir=pipeline_state, socket=tmp_path / "b.sock",
                                  relay_url=local_relay)
    restored = _cli(restore_config, "keys", "restore", "--identity", str(identity[0]),
                    str(files[0]), "--yes")
    assert restored.returncode == 0, restored.stderr
    assert "restored 2 agents; 0 already held" in restored.stderr
    assert all(pubkey in restored.stdout for pubkey in agents)

    # No secret in what the commands printed, the key-event log, or the custodian's log
    # and stderr; the backup file holds them only encrypted.
    scan = SecretScan()
    for number, secret in enumerate(secrets):
        scan.add(key_secret(f"agent {number}", secret.secret.hex()))
    leaks = scan.findings(done.stdout + done.stderr + restored.stdout + restored.stderr,
                          "the commands' output")
    leaks += scan.findings(key_event_bytes(pipeline_state), "the key-event log")
    leaks += scan.findings(log.read_bytes(), "the custodian's log")
    leaks += scan.findings(backing_custodian.stop(), "the custodian's stderr")
    leaks += scan.findings(files[0].read_bytes(), "the backup file")
    assert not leaks, leaks


async def test_backup_added_to_a_running_custodians_file_is_refused_until_it_restarts(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
        identity: tuple[Path, str]) -> None:
    """The custodian reads its file at start only. An operator who adds `[backup]` to the
    file of a custodian that runs is told it is the running custodian's configuration
    that has none, and to restart it (docs/install.md, "Back up"); restarted, it backs
    up. (A runbook walk: the refusal said to put `[backup]` in its file, which held it.)"""
    token, state_dir = custody_state
    pipeline_state = tmp_path / "pipeline-state"
    pipeline_state.mkdir(mode=0o700)
    with running_custodian(custody_state, local_relay, tmp_path) as process:
        client = CustodianClient(process.socket)
        agent = (await client.mint_agent(owner=human())).pubkey
        await client.aclose()
        config = write_config(tmp_path / "broker.toml", token=token, state_dir=pipeline_state,
                              socket=tmp_path / "b.sock", relay_url=local_relay,
                              sections={"custody": {"custodian_socket": str(process.socket)}})
        write_custodian_config(process.config, token=token, state_dir=state_dir,
                               socket=process.socket, relay_url=local_relay,
                               backup={"recipients": [identity[1]],
                                       "dir": str(tmp_path / "backups")})
        assert "[backup]" in process.config.read_text()
        refused = _cli(config, "keys", "backup")
        assert refused.returncode == 1, refused.stderr
        assert refused.stderr.splitlines()[-1] == (
            "buzz-broker: custodian: no backup is configured in the running custodian: it "
            "reads [backup] from its file at start only; restart it after adding [backup]")
        assert not (tmp_path / "backups").exists()
        process.start()  # the restart (systemctl restart buzz-custodian.service)
        done = _cli(config, "keys", "backup")
        assert done.returncode == 0, done.stderr
        [written] = (tmp_path / "backups").iterdir()
        assert f"backed up 1 agents to {written}" in done.stdout
        with open_backup(written.read_bytes(), bytearray(identity[0].read_bytes())) as contents:
            assert {r.pubkey for r in contents.records} == {agent}


@pytest.mark.parametrize("table, fault", [
    ('[backup]\nrecipients = ["age1notakey"]\ndir = "b"\n', "is not an age X25519 recipient"),
    ('[backup]\nrecipients = []\ndir = "b"\n', "needs dir and 1 to 64 recipients"),
    ('[backup]\nrecipients = ["{r}"]\n', "needs dir and 1 to 64 recipients"),
    ('[backup]\nrecipients = ["{r}"]\ndir = "b"\nout = "x"\n', "unknown key [backup] out"),
])
def test_a_backup_table_that_is_not_whole_is_refused_at_start(
        tmp_path: Path, identity: tuple[Path, str], table: str, fault: str) -> None:
    base = write_custodian_config(tmp_path / "c.toml", token=TokenConfig("m", "t", None),
                                  state_dir=tmp_path, socket=tmp_path / "s", relay_url="wss://r")
    base.write_text(base.read_text() + table.replace("{r}", identity[1]))
    with pytest.raises(ConfigError, match=re.escape(fault)):
        load(str(base))


def test_an_identity_given_as_a_recipient_is_refused_unquoted(
        tmp_path: Path, identity: tuple[Path, str]) -> None:
    # An age identity opens every backup: the refusal (the unit's stderr, the journal)
    # names its place, never the text.
    [secret] = [line for line in identity[0].read_text().splitlines()
                if line.startswith("AGE-SECRET-KEY-")]
    base = write_custodian_config(tmp_path / "c.toml", token=TokenConfig("m", "t", None),
                                  state_dir=tmp_path, socket=tmp_path / "s", relay_url="wss://r")
    base.write_text(base.read_text() + f'[backup]\nrecipients = ["{identity[1]}", "{secret}"]\n'
                    'dir = "b"\n')
    with pytest.raises(ConfigError) as refused:
        load(str(base))
    assert "recipient 2 is not an age X25519 recipient" in str(refused.value)
    assert secret.lower() not in str(refused.value).lower()


async def test_the_backup_row_takes_no_recipient_or_path(
        backing_custodian: CustodianProcess, custody_state: tuple[TokenConfig, Path],
        local_relay: str, identity: tuple[Path, str], tmp_path: Path) -> None:
    for extra in ({"recipients": [identity[1]]}, {"dir": str(tmp_path)},
                  {"path": str(tmp_path / "x.age")}, {"out": str(tmp_path / "x.age")}):
        ok, answer = ask(backing_custodian.socket, "backup", names=[], **extra)
        assert not ok and answer[0] == "bad_message", (extra, answer)  # type: ignore[index]
    assert list((tmp_path / "backups").glob("*")) == []
    # A custodian with no [backup] (its own socket: a socket someone answers on is never
    # taken over) refuses the row, and nothing is written.
    (tmp_path / "plain").mkdir()
    with running_custodian(custody_state, local_relay, tmp_path / "plain") as plain:
        ok, answer = ask(plain.socket, "backup", names=[])
    assert not ok and answer[0] == "refused", answer  # type: ignore[index]
    assert list((tmp_path / "backups").glob("*")) == []
