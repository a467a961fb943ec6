"""`buzz-broker keys backup` / `keys restore` as an operator runs them, against the session's
token (SoftHSM in the main suite; every kind in the four-token run).

"Another host" here is a second state directory under a second KEK: restore must seal under
that KEK (the drill, tests/backup/test_drill.py, does it with a new token and the daemon).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyrage
import pytest
import trio

from custody import Custody, TokenConfig
from custody._sealed import SEAL_CODES
from daemon.state.audit import verify
from daemon.state.directory import AgentDirectory
from daemon.state.key_events import KEY_EVENTS_DIRNAME
from tests.custody._sealing import SEAL_KINDS, blob_of
from tests.custody._secrets import PUB_1, PUB_2, PUB_3, SECRET_1, SECRET_X, assert_no_secrets
from tests.custody.test_cli import Cli
from tests.fixtures.token import REPO, SoftHsmToken

SLUGS = ("core", "mem/plans")


def age_identity(path: Path) -> str:
    """`age-keygen -o path` (Debian's age): returns the public recipient it printed."""
    done = subprocess.run(["age-keygen", "-o", str(path)], capture_output=True, text=True,
                          check=True, timeout=30)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return done.stderr.strip().removeprefix("Public key: ")


class Host:
    """One host: its own state dir and KEK in the session token, driven through the CLI."""

    def __init__(self, token: SoftHsmToken, directory: Path) -> None:
        directory.mkdir()
        self.cli = Cli(token, directory)
        self.token = token
        assert self.cli("keys", "init").returncode == 0

    def __call__(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return self.cli(*args, stdin=stdin)

    @property
    def config(self) -> TokenConfig:
        return self.token.config(kek_label=self.cli.kek_label)

    def agents(self) -> list[dict[str, object]]:
        """The live agents' public records (as `agent list --json` prints them)."""
        directory = AgentDirectory.open(self.cli.state)
        try:
            return [r.to_json_obj() for r in sorted(directory.agents(), key=lambda r: r.pubkey)]
        finally:
            directory.close()

    def d_tags(self) -> dict[str, list[str]]:
        async def derive() -> dict[str, list[str]]:
            async with await Custody.open(self.config, self.cli.state) as custody:
                return {r.pubkey: [(await custody.memory_address(r.pubkey, s)).d_tag for s in SLUGS]
                        for r in custody.agents()}

        return trio.run(derive)

    def files(self) -> bytes:
        return b"".join(p.read_bytes() for p in sorted(self.cli.state.iterdir()) if p.is_file())


def key_event_bytes(state: Path) -> bytes:
    """Every byte of the key-event log (after checking its chain)."""
    log = state / KEY_EVENTS_DIRNAME
    assert verify(log).ok
    return b"".join(p.read_bytes() for p in sorted(log.iterdir()))


def key_events(state: Path) -> list[dict[str, object]]:
    """The key-event log's lines, parsed, in order."""
    return [json.loads(line) for line in key_event_bytes(state).splitlines()]


@dataclass(frozen=True)
class Made:
    """The module's source host, made once: three agents, backed up once."""

    host: Host
    out: Path
    identity: Path
    #: The source's agents and d-tags, read right after the backup.
    agents: list[dict[str, object]]
    d_tags: dict[str, list[str]]


@pytest.fixture(scope="module")
def made(softhsm_token: SoftHsmToken, tmp_path_factory: pytest.TempPathFactory) -> Made:
    """A human-owned boss, its helper (NIP-OA tagged by boss), and one more agent."""
    directory = tmp_path_factory.mktemp("backup-source")
    host = Host(softhsm_token, directory / "source")
    boss = host("agent", "import", "--owner", PUB_2, "--name", "boss", stdin=SECRET_X).stdout.strip()
    assert host("agent", "create", "--owner", boss, "--name", "helper").returncode == 0
    assert host("agent", "import", "--owner", PUB_3, stdin=SECRET_1).stdout.strip() == PUB_1
    identity = directory / "identity.txt"
    out = directory / "agents.age"
    done = host("keys", "backup", "--recipient", age_identity(identity), "--out", str(out))
    assert done.returncode == 0, done.stderr
    return Made(host, out, identity, host.agents(), host.d_tags())


@pytest.fixture
def target(softhsm_token: SoftHsmToken, tmp_path: Path) -> Host:
    return Host(softhsm_token, tmp_path / "target")


def test_round_trip_keeps_pubkeys_nip_oa_tags_and_d_tags(made: Made, target: Host) -> None:
    source, out, identity = made.host, made.out, made.identity
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert out.read_bytes().startswith(b"age-encryption.org/v1\n")
    done = target("keys", "restore", "--identity", str(identity), str(out), "--yes")
    assert done.returncode == 0, done.stderr
    assert target.agents() == made.agents and len(made.agents) == 3
    assert done.stdout.count("  restore  ") == 3
    assert target.d_tags() == made.d_tags
    # Sealed under the target's own KEK: the source's blobs are not what the target holds.
    assert target.files() != source.files()
    # Restoring again changes nothing: every agent is already held, with the same owner.
    again = target("keys", "restore", "--identity", str(identity), str(out))
    assert again.returncode == 0 and again.stdout.count("already held") == 3
    # The key-event log (a hash chain of its own): intent, then outcome, for each run.
    events = key_events(target.cli.state)
    assert [(e["event"], e["stage"], e["agents"]) for e in events] == [
        ("restore", "intent", None), ("restore", "done", 3),
        ("restore", "intent", None), ("restore", "done", 0)]
    assert events[1]["held"] == 0 and events[3]["held"] == 3
    assert sorted(events[1]["pubkeys"]) == sorted(str(a["pubkey"]) for a in made.agents)
    assert {e["sha256"] for e in events} == {hashlib.sha256(out.read_bytes()).hexdigest()}
    backed = key_events(source.cli.state)
    assert [(e["event"], e["stage"]) for e in backed] == [("backup", "intent"), ("backup", "done")]
    assert backed[1]["agents"] == 3 and backed[1]["uid"] == os.getuid()
    assert backed[1]["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert not (source.cli.state / "key-events.jsonl").exists()  # the old plain file: no more
    scanned = (source.cli.transcript + target.cli.transcript + out.read_bytes()
               + source.files() + target.files() + key_event_bytes(source.cli.state)
               + key_event_bytes(target.cli.state))
    assert_no_secrets(scanned)
    assert b"AGE-SECRET-KEY" not in scanned


def test_the_backup_is_a_plain_age_file_holding_the_documented_format(made: Made) -> None:
    out, identity = made.out, made.identity
    # age's own tool opens it (to stdout, kept in memory: never write this in clear).
    plain = subprocess.run(["age", "--decrypt", "--identity", str(identity), str(out)],
                           capture_output=True, check=True, timeout=30).stdout
    lines = plain.splitlines()
    assert lines[0].startswith(b"buzz-broker-backup/v2 ")
    assert json.loads(lines[0].split(b" ", 1)[1])["agents"] == 3 == len(lines) - 1
    secrets = {line[:64] for line in lines[1:]}
    assert SECRET_X.encode() in secrets and SECRET_1.encode() in secrets


def test_wrong_identity_or_a_damaged_file_restores_nothing(
    made: Made, target: Host, tmp_path: Path
) -> None:
    out = made.out
    stranger = tmp_path / "stranger.txt"
    age_identity(stranger)
    done = target("keys", "restore", "--identity", str(stranger), str(out), "--yes")
    assert done.returncode == 1 and "does not decrypt" in done.stderr
    damaged = tmp_path / "damaged.age"
    data = bytearray(out.read_bytes())
    data[-20] ^= 1
    damaged.write_bytes(bytes(data))
    done = target("keys", "restore", "--identity", str(made.identity), str(damaged), "--yes")
    assert done.returncode == 1 and "does not decrypt" in done.stderr
    assert target.agents() == []
    assert "Traceback" not in target.cli.transcript.decode()


def forge(out: Path, identity: Path, tmp_path: Path, edit: object) -> Path:
    """What anyone who knows the recipient can do: decrypt nothing, write a new backup.

    Here the test decrypts the real one (it holds the identity), edits one record with
    `edit(record) -> None`, and encrypts the result to the same recipient.
    """
    ident = pyrage.x25519.Identity.from_str(
        next(l for l in identity.read_text().splitlines() if l.startswith("AGE-SECRET-KEY")))
    lines = pyrage.decrypt(out.read_bytes(), [ident]).split(b"\n")
    secret, record = lines[1].split(b" ", 1)
    obj = json.loads(record)
    edit(obj)  # type: ignore[operator]
    lines[1] = secret + b" " + json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    forged = tmp_path / f"forged-{len(list(tmp_path.glob('forged-*')))}.age"
    forged.write_bytes(pyrage.encrypt(b"\n".join(lines), [ident.to_public()]))
    return forged


def _other_pubkey(record: dict[str, object]) -> None:
    record["pubkey"] = "ab" * 32  # hex, no owner's key: only the derivation check can refuse


def _bad_tag_signature(record: dict[str, object]) -> None:
    tag = record["authTag"]
    assert isinstance(tag, list)
    tag[3] = tag[3][:-1] + ("0" if tag[3][-1] != "0" else "1")


def _tag_of_another_owner(record: dict[str, object]) -> None:
    record["owner"] = PUB_3


@pytest.mark.parametrize("edit, tagged, message", [
    (_other_pubkey, False, "does not derive pubkey"),
    (_bad_tag_signature, True, "NIP-OA tag does not verify"),
    (_tag_of_another_owner, True, "NIP-OA tag does not verify"),
])
def test_a_forged_backup_is_refused_whole(
    made: Made, target: Host, tmp_path: Path, edit: object, tagged: bool, message: str
) -> None:
    identity = made.identity
    out = tmp_path / "reordered.age"

    def checked(record: dict[str, object]) -> None:
        assert (record["authTag"] is not None) is tagged
        edit(record)  # type: ignore[operator]

    # Put a record with (or without) a NIP-OA tag first: the edit hits that one, so each
    # case proves one check (an untagged record's forged pubkey meets no tag check).
    ident = pyrage.x25519.Identity.from_str(
        next(l for l in identity.read_text().splitlines() if l.startswith("AGE-SECRET-KEY")))
    lines = pyrage.decrypt(made.out.read_bytes(), [ident]).split(b"\n")
    body = [l for l in lines[1:] if l]
    body.sort(key=lambda l: (b'"authTag":null' in l) == tagged)
    out.write_bytes(pyrage.encrypt(b"\n".join([lines[0], *body, b""]), [ident.to_public()]))
    forged = forge(out, identity, tmp_path, checked)
    done = target("keys", "restore", "--identity", str(identity), str(forged), "--yes")
    assert done.returncode == 1 and message in done.stderr and "entry 1" in done.stderr
    assert target.agents() == []
    assert_no_secrets(target.cli.transcript)


def test_restore_refuses_to_overwrite_a_different_agent(made: Made, target: Host) -> None:
    # The target already holds PUB_1's key, for another owner than the backup says.
    assert target("agent", "import", "--owner", PUB_2, stdin=SECRET_1).stdout.strip() == PUB_1
    before = target.agents()
    done = target("keys", "restore", "--identity", str(made.identity), str(made.out), "--yes")
    assert done.returncode == 1 and "for another owner" in done.stderr
    assert target.agents() == before


def test_a_removed_agent_does_not_come_back_through_a_backup(made: Made, target: Host) -> None:
    assert target("agent", "import", "--owner", PUB_3, stdin=SECRET_1).returncode == 0
    assert target("agent", "remove", PUB_1, "--yes").returncode == 0
    done = target("keys", "restore", "--identity", str(made.identity), str(made.out), "--yes")
    assert done.returncode == 1 and "was removed on this host" in done.stderr
    assert target.agents() == []


def test_restore_asks_and_refuses_without_a_terminal_or_yes(made: Made, target: Host) -> None:
    done = target("keys", "restore", "--identity", str(made.identity), str(made.out))
    assert done.returncode == 1 and "--yes" in done.stderr
    assert done.stdout.count("  restore  ") == 3  # it listed what it would import
    assert target.agents() == []


def test_backup_never_overwrites_and_identity_must_be_private(
    made: Made, target: Host, tmp_path: Path
) -> None:
    source, out = made.host, made.out
    before = out.read_bytes()
    recipient = age_identity(tmp_path / "second.txt")
    done = source("keys", "backup", "--recipient", recipient, "--out", str(out))
    assert done.returncode == 1 and "exists" in done.stderr and out.read_bytes() == before
    bad = source("keys", "backup", "--recipient", "age1notakey", "--out", str(tmp_path / "x.age"))
    assert bad.returncode == 2 and "not an age X25519 recipient" in bad.stderr  # usage
    # The identity given where a recipient belongs (it opens every backup) is not quoted.
    [secret] = [line for line in made.identity.read_text().splitlines()
                if line.startswith("AGE-SECRET-KEY-")]
    mistaken = source("keys", "backup", "--recipient", secret, "--out", str(tmp_path / "x.age"))
    assert mistaken.returncode == 2 and "--recipient 1 is not an age" in mistaken.stderr
    assert secret not in mistaken.stdout + mistaken.stderr
    assert secret.lower() not in (mistaken.stdout + mistaken.stderr).lower()
    assert not (tmp_path / "x.age").exists()  # removed: nothing half-written stays
    loose = tmp_path / "loose.txt"
    loose.write_bytes(made.identity.read_bytes())
    loose.chmod(0o644)
    done = target("keys", "restore", "--identity", str(loose), str(out), "--yes")
    assert done.returncode == 1 and "readable by group or others" in done.stderr
    assert target.agents() == []


@pytest.mark.parametrize("step", ["export", "write"])
def test_a_backup_killed_midway_leaves_nothing_under_its_name_and_the_rerun_writes_it(
    softhsm_token: SoftHsmToken, tmp_path: Path, step: str
) -> None:
    """SIGKILLed (no `finally` runs: the OOM killer, a power cut) once every agent is
    encrypted, or halfway through the file's bytes (tests/backup/crashing_backup.py), the
    command leaves no file under `--out`: an empty or torn 0600 file there passed for a
    backup, and the rerun refused its name. Only the killed run's partial file is left
    beside it, which the rerun removes before it writes the backup."""
    host = Host(softhsm_token, tmp_path / "host")
    pubkey = host("agent", "import", "--owner", PUB_2, stdin=SECRET_X).stdout.strip()
    identity, backups = tmp_path / "identity.txt", tmp_path / "backups"
    backups.mkdir()
    out, recipient = backups / "agents.age", age_identity(identity)
    argv = ("keys", "backup", "--recipient", recipient, "--out", str(out))
    killed = subprocess.run(
        [sys.executable, "-m", "tests.backup.crashing_backup", step, "--config",
         str(host.cli.config), *argv],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=dict(os.environ))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert f"crashing_backup.kill step={step}" in killed.stderr
    assert not os.path.lexists(out)
    [partial] = backups.iterdir()
    assert partial.name.startswith(".agents.age.") and partial.name.endswith(".partial")
    assert [(e["event"], e["stage"]) for e in key_events(host.cli.state)] == [
        ("backup", "intent")]  # killed: an intent without an outcome

    again = host(*argv)
    assert again.returncode == 0, again.stderr
    assert [p.name for p in backups.iterdir()] == ["agents.age"]  # the partial is gone,
    assert str(partial) in again.stderr  # and said
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    secret = next(line for line in identity.read_text().splitlines()
                  if line.startswith("AGE-SECRET-KEY-"))
    plaintext = pyrage.decrypt(out.read_bytes(), [pyrage.x25519.Identity.from_str(secret)])
    assert plaintext.startswith(b"buzz-broker-backup/v2 ") and pubkey.encode() in plaintext
    events = key_events(host.cli.state)
    assert [(e["event"], e["stage"]) for e in events] == [
        ("backup", "intent"), ("backup", "intent"), ("backup", "done")]
    assert events[2]["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()


def _rewrite(made: Made, tmp_path: Path, format_line: bytes | None, edit: object) -> Path:
    """The made backup re-encrypted with its format line replaced and `edit(record)` applied
    to every record (anyone who knows the recipient can write such a file)."""
    ident = pyrage.x25519.Identity.from_str(
        next(l for l in made.identity.read_text().splitlines() if l.startswith("AGE-SECRET-KEY")))
    lines = pyrage.decrypt(made.out.read_bytes(), [ident]).split(b"\n")
    if format_line is not None:
        lines[0] = format_line + b" " + lines[0].split(b" ", 1)[1]
    for i, line in enumerate(lines[1:], start=1):
        if line:
            secret, record = line.split(b" ", 1)
            obj = json.loads(record)
            edit(obj)  # type: ignore[operator]
            lines[i] = secret + b" " + json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    out = tmp_path / "rewritten.age"
    out.write_bytes(pyrage.encrypt(b"\n".join(lines), [ident.to_public()]))
    return out


def _as_version_1(record: dict[str, object]) -> None:
    public = record.pop("public")
    assert isinstance(public, dict)
    record.update(name=public["name"], creator=public["creator"], depth=1)


def test_a_version_1_backup_restores_with_its_names(made: Made, target: Host, tmp_path: Path) -> None:
    """Backups written when custody still held names (format v1) restore unchanged: the
    names go to the directory, the stored depth is dropped and derived again."""
    old = _rewrite(made, tmp_path, b"buzz-broker-backup/v1", _as_version_1)
    done = target("keys", "restore", "--identity", str(made.identity), str(old), "--yes")
    assert done.returncode == 0, done.stderr
    assert target.agents() == made.agents
    assert sorted(r["depth"] for r in made.agents) == [1, 1, 2]  # not the file's depth 1


def test_a_backup_entry_without_a_valid_name_restores_the_key(
    made: Made, target: Host, tmp_path: Path
) -> None:
    def nameless(record: dict[str, object]) -> None:
        record["public"] = {"name": ["\x1b[2J"], "creator": None}

    done = target("keys", "restore", "--identity", str(made.identity),
                  str(_rewrite(made, tmp_path, None, nameless)), "--yes")
    assert done.returncode == 0 and done.stderr.count("restored without its name") == 3
    assert [r["name"] for r in target.agents()] == [r["pubkey"][:12] for r in target.agents()]
    assert "\x1b" not in done.stdout + done.stderr

    def oversized(record: dict[str, object]) -> None:
        record["public"] = {"name": "x" * 5000}

    fresh = Host(target.token, tmp_path / "fresh")
    done = fresh("keys", "restore", "--identity", str(made.identity),
                 str(_rewrite(made, tmp_path, None, oversized)), "--yes")
    assert done.returncode == 1 and "bad public entry" in done.stderr and fresh.agents() == []


@pytest.mark.parametrize("seal", SEAL_KINDS)
def test_backup_and_restore_keep_the_configured_seal(
    softhsm_token: SoftHsmToken, tmp_path: Path, seal: str
) -> None:
    """`[pkcs11] seal` reaches every command that opens the token: a key restored under a
    forced seal is sealed with that seal, as `agent create` seals (one mapping,
    daemon/config.py `Pkcs11Config.token`). Before, restore built its own token settings
    without the seal and sealed with whatever `auto` chose."""
    hosts = []
    for name in ("source", "target"):
        host = Host(softhsm_token, tmp_path / name)
        with host.cli.config.open("a") as config:
            config.write(f'seal = "{seal}"\n')
        assert host("keys", "init").returncode == 0  # adds the forced seal's key if missing
        hosts.append(host)
    source, target = hosts
    made = source("agent", "import", "--owner", PUB_2, stdin=SECRET_1)
    assert (made.returncode, made.stdout.strip()) == (0, PUB_1), made.stderr
    assert blob_of(source.cli.state, PUB_1)[1] == SEAL_CODES[seal]
    identity, out = tmp_path / "identity.txt", tmp_path / "agents.age"
    done = source("keys", "backup", "--recipient", age_identity(identity), "--out", str(out))
    assert done.returncode == 0, done.stderr
    done = target("keys", "restore", "--identity", str(identity), str(out), "--yes")
    assert done.returncode == 0, done.stderr
    assert blob_of(target.cli.state, PUB_1)[1] == SEAL_CODES[seal]
