"""`buzz-broker keys` and `buzz-broker agent` as an operator runs them: a subprocess each."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import nostr_sdk
import pytest

from buzzwire.nostr import owner_tag_digest
from tests.custody._secrets import (PUB_1, PUB_2, PUB_3, SECRET_1, SECRET_2, SECRET_X,
                                    assert_no_secrets)
from tests.fixtures.token import REPO, SoftHsmToken, ensure_operator_keys
from tests.json_lines import json_lines

BUZZ_BROKER = REPO / ".venv" / "bin" / "buzz-broker"


class Cli:
    def __init__(self, token: SoftHsmToken, directory: Path) -> None:
        self.token = token
        self.config = directory / "broker.toml"
        self.state = directory / "state"
        # A KEK per test: the token is shared by the session, "no KEK yet" must be true here.
        self.kek_label = f"cli-kek-{directory.name}"
        self.transcript = b""
        self.write_config(token.pin_file)

    def write_config(self, pin_file: str) -> None:
        self.config.write_text(
            f'[state]\ndir = "{self.state}"\n'
            f'[pkcs11]\nmodule = "{self.token.module}"\ntoken_label = "{self.token.label}"\n'
            f'pin_file = "{pin_file}"\nkek_label = "{self.kek_label}"\n'
        )

    def __call__(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        if args[:2] == ("keys", "init"):
            ensure_operator_keys(self.token, self.kek_label)  # a TPM's operator makes the KEK
        done = subprocess.run(
            [str(BUZZ_BROKER), "--config", str(self.config), *args],
            input=stdin, capture_output=True, text=True, timeout=60, env=dict(os.environ),
        )
        self.transcript += (done.stdout + done.stderr).encode()
        assert "Traceback" not in done.stderr
        return done


@pytest.fixture
def cli(softhsm_token: SoftHsmToken, tmp_path: Path) -> Cli:
    return Cli(softhsm_token, tmp_path)


def test_done_when_import_of_secret_one_prints_its_pubkey(cli: Cli, tmp_path: Path) -> None:
    done = cli("keys", "init")
    assert done.returncode == 0 and cli.kek_label in done.stdout
    assert cli("keys", "init").returncode == 0  # idempotent: found and checked
    done = cli("agent", "import", "--owner", PUB_2, stdin=SECRET_1 + "\n")
    assert (done.returncode, done.stdout) == (0, PUB_1 + "\n")
    assert_no_secrets(cli.transcript + (cli.state / "keystore.db").read_bytes())


def test_agent_lifecycle_and_faults(cli: Cli, tmp_path: Path) -> None:
    assert cli("agent", "import", "--owner", PUB_2, stdin=SECRET_1).returncode == 1  # no KEK yet
    assert cli("keys", "init").returncode == 0
    nsec = nostr_sdk.SecretKey.parse(SECRET_X).to_bech32()
    owner = cli("agent", "import", "--owner", PUB_2, "--name", "boss", stdin=nsec + "\n").stdout.strip()
    assert owner == nostr_sdk.Keys.parse(SECRET_X).public_key().to_hex()
    created = cli("agent", "create", "--owner", owner, "--name", "helper")
    assert created.returncode == 0
    helper = created.stdout.strip()
    listed = json_lines(cli("agent", "list", "--json").stdout)
    by_key = {r["pubkey"]: r for r in listed}
    assert by_key[helper]["owner"] == owner and by_key[helper]["depth"] == 2
    assert by_key[helper]["authTag"][:3] == ["auth", owner, ""]
    assert (by_key[owner]["name"], by_key[helper]["name"]) == ("boss", "helper")
    # Names are the directory's: `agent name` sets one, and nothing in custody changes.
    keystore = (cli.state / "keystore.db").read_bytes()
    named = cli("agent", "name", helper, "scout")
    assert named.returncode == 0 and "'scout'" in named.stderr
    assert {r["pubkey"]: r["name"] for r in json_lines(cli("agent", "list", "--json").stdout)
            }[helper] == "scout"
    assert (cli.state / "keystore.db").read_bytes() == keystore
    assert cli("agent", "remove", "--yes", helper).returncode == 0
    assert helper not in cli("agent", "list").stdout
    assert helper in cli("agent", "list", "--all").stdout

    # (argv, stdin, exit code, what the line says): 2 for a malformed argument (usage),
    # 1 for input or state that refuses a well-formed one (docs/operations.md, exit codes).
    faults = [
        (("agent", "import", "--owner", PUB_1), SECRET_1, 1, "cannot own itself"),
        (("agent", "import", "--owner", PUB_2), "0123", 1, "malformed secret"),
        (("agent", "import", "--owner", "XYZ"), SECRET_2, 2, "--owner"),
        (("agent", "import", "--owner", "b" * 64), SECRET_2, 2, "not a secp256k1"),
        (("agent", "create", "--owner", "b" * 64, "--name", "x"), "", 2, "not a secp256k1"),
        (("agent", "import", "--owner", PUB_2), nsec, 1, "already held"),
        (("agent", "import", "--owner", PUB_2, "--auth-tag", "[1,"), SECRET_2, 2, "not JSON"),
        (("agent", "remove", "--yes", PUB_3), "", 1, "unknown agent"),
        (("agent", "name", helper, "ghost"), "", 1, "no live agent"),
        (("agent", "name", owner, ""), "", 2, "NAME: name must be 1 to 256 characters"),
        (("agent", "import", "--owner", PUB_2, "--name", ""), SECRET_2, 2,
         "1 to 256 characters"),
        # A name the directory refuses is refused before a key is made or a secret read:
        # it was made first, then the command ended "internal error" without its pubkey.
        (("agent", "create", "--owner", owner, "--name", "x" * 257), "", 2,
         "1 to 256 characters"),
        (("agent", "import", "--owner", PUB_2, "--name", "x" * 257), SECRET_2, 2,
         "--name: name must be 1 to 256 characters"),
        (("agent", "name", owner, "x" * 257), "", 2, "1 to 256 characters"),
    ]
    held = cli("agent", "list", "--all").stdout
    for args, stdin, code, message in faults:
        done = cli(*args, stdin=stdin)
        assert (done.returncode, done.stdout) == (code, "") and message in done.stderr, done
    assert cli("agent", "list", "--all").stdout == held  # no key made by any of them
    wrong_pin = tmp_path / "wrong"
    wrong_pin.write_text("nope\n")
    wrong_pin.chmod(0o600)
    cli.write_config(str(wrong_pin))
    done = cli("agent", "create", "--owner", PUB_2, "--name", "x")
    assert done.returncode == 1 and "wrong PIN" in done.stderr
    assert_no_secrets(cli.transcript + (cli.state / "keystore.db").read_bytes())


def test_agent_remove_in_process_says_the_key_is_destroyed_for_good(cli: Cli) -> None:
    """Custody in this process deletes the sealed blob: the question and the result line
    say "for good", and name no custodian's command (under a custodian they say a copy is
    kept: tests/custodian/test_commands.py)."""
    assert cli("keys", "init").returncode == 0
    agent = cli("agent", "create", "--owner", PUB_2, "--name", "gone").stdout.strip()
    removed = cli("agent", "remove", agent, stdin="yes\n")
    assert removed.returncode == 0, removed.stderr
    question, result = removed.stderr.strip().splitlines()
    for said in (question, result):
        assert "destroyed for good" in said and "custodian" not in said, said
    assert agent in cli("agent", "list", "--all").stdout
    assert agent not in cli("agent", "list").stdout


def test_import_buffer_is_zeroed_when_custody_never_opens(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Custody refuses before import_agent runs (no KEK yet): the CLI zeroes the buffer."""
    import argparse

    from daemon.cli import agent as agent_cli
    from daemon.cli._common import CliError
    from daemon.config import load_config

    held: list[bytearray] = []

    def read(_fd: int) -> bytearray:
        held.append(bytearray(SECRET_2.encode("ascii")))
        return held[0]

    monkeypatch.setattr(agent_cli, "_read_secret", read)
    args = argparse.Namespace(owner=PUB_2, name=None, auth_tag=None)
    with open(os.devnull) as devnull, pytest.raises(CliError) as raised:
        monkeypatch.setattr("sys.stdin", devnull)  # pytest's stdin has no fileno
        agent_cli._import(args, load_config(str(cli.config)))
    assert "keys init" in str(raised.value)  # control: custody refused at open, no KEK
    assert held and held[0] == bytearray(len(SECRET_2))


def test_import_on_a_terminal_prompts_on_stderr_and_does_not_echo(cli: Cli) -> None:
    import pty
    import select
    import termios

    assert cli("keys", "init").returncode == 0
    master, slave = pty.openpty()
    try:
        child = subprocess.Popen(
            [str(BUZZ_BROKER), "--config", str(cli.config), "agent", "import", "--owner", PUB_2],
            stdin=slave, stdout=subprocess.PIPE, stderr=slave, env=dict(os.environ),
        )
        seen = b""

        def read_until(needle: bytes) -> None:
            nonlocal seen
            for _ in range(200):  # bounded: 20 s at most
                if needle in seen:
                    return
                if select.select([master], [], [], 0.1)[0]:
                    seen += os.read(master, 4096)
            raise AssertionError(f"never saw {needle!r}")

        read_until(b"not echoed")
        for _ in range(100):  # the child turns echo off right after the prompt
            if not termios.tcgetattr(slave)[3] & termios.ECHO:
                break
            select.select([], [], [], 0.05)
        assert not termios.tcgetattr(slave)[3] & termios.ECHO
        os.write(master, SECRET_1.encode() + b"\n")
        os.write(master, b"\x04")  # Ctrl-D: end of input
        assert child.stdout is not None
        with child.stdout:
            out = child.stdout.read()
        assert child.wait(timeout=60) == 0
        read_until(b"\n")
        if select.select([master], [], [], 0.2)[0]:
            seen += os.read(master, 4096)
        assert out == (PUB_1 + "\n").encode()
        assert termios.tcgetattr(slave)[3] & termios.ECHO  # restored
        assert SECRET_1.encode() not in seen and SECRET_1[:16].encode() not in seen
    finally:
        os.close(master)
        os.close(slave)


@pytest.mark.token_offers("AES_GCM", "GENERATE_KEY")  # SoftHSM's report, then etm forced
def test_keys_init_says_what_the_token_offers_and_which_seal_it_uses(cli: Cli) -> None:
    done = cli("keys", "init")
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"token {cli.token.label!r} offers: gcm (")
    assert "etm (" in lines[0] and lines[0].endswith("generates keys: yes")
    assert lines[1].startswith("seal for new keys: gcm (AES-256-GCM") and "chosen" in lines[1]
    assert lines[2] == (f"KEK {cli.kek_label!r} created sensitive, non-extractable, private, "
                        f"in token {cli.token.label!r}")
    cli.config.write_text(cli.config.read_text() + 'seal = "etm"\n')  # [pkcs11] is last
    done = cli("keys", "init")
    assert done.returncode == 0 and "seal for new keys: etm" in done.stdout
    assert "forced by [pkcs11] seal" in done.stdout
    assert f"KEK '{cli.kek_label}-mac' created" in done.stdout
    assert f"KEK {cli.kek_label!r} present and checked" in done.stdout


@pytest.mark.token_offers("GENERATE_KEY")  # rotation without --new-kek-label makes one
def test_keys_rotate_through_the_cli_and_its_refusals(cli: Cli) -> None:
    assert cli("keys", "init").returncode == 0
    assert cli("agent", "import", "--owner", PUB_2, stdin=SECRET_1).returncode == 0
    done = cli("keys", "rotate")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"resealed 1 agent(s): KEK {cli.kek_label!r}")
    assert f"destroyed in token {cli.token.label!r}: {cli.kek_label!r}" in done.stdout
    # keys init now checks the KEK the keystore names, not the configured first one.
    init = cli("keys", "init")
    assert init.returncode == 0 and f"KEK {cli.kek_label!r}" not in init.stdout
    assert "present and checked" in init.stdout
    created = cli("agent", "create", "--owner", PUB_2, "--name", "after")
    assert created.returncode == 0  # custody opens with the rotated KEK
    same = cli("keys", "migrate", "--to-config", str(cli.config))
    assert same.returncode == 1 and "use `keys rotate`" in same.stderr
    assert_no_secrets(cli.transcript + (cli.state / "keystore.db").read_bytes())


@pytest.mark.token_offers("GENERATE_KEY")  # rotation without --new-kek-label makes one
def test_keys_rotate_refuses_while_the_daemon_holds_custody(cli: Cli) -> None:
    """Another process (here, a held-open custody like the daemon's) has the state
    directory: the rotation refuses at once and says to stop the daemon."""
    assert cli("keys", "init").returncode == 0
    holder = subprocess.Popen(
        [str(REPO / ".venv" / "bin" / "python"), "-c",
         "import sys, trio\n"
         "from pathlib import Path\n"
         "from daemon.config import load_config\n"
         "from custody import Custody\n"
         "c = load_config(sys.argv[1])\n"
         "async def main():\n"
         "    opened = await Custody.open(c.pkcs11.token(), Path(c.state.dir))\n"
         "    print('open', flush=True)\n"
         "    sys.stdin.read()\n"
         "    await opened.aclose()\n"
         "trio.run(main)\n", str(cli.config)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        done = cli("keys", "rotate")
        assert done.returncode == 1 and "stop the daemon" in done.stderr
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
        assert holder.stdout is not None
        holder.stdout.close()
    assert cli("keys", "rotate").returncode == 0


def test_create_for_a_person_says_what_the_owner_must_sign_and_for_a_held_owner_nothing(
        cli: Cli) -> None:
    """`agent create --owner` for an owner not held here (a person) leaves the agent with no
    NIP-OA tag: stderr says what the owner signs (the preimage's sha256) and the command
    that attaches it. For an owner held here the host signs the tag itself: no such text."""
    assert cli("keys", "init").returncode == 0
    person = cli("agent", "create", "--owner", PUB_2, "--name", "for-a-person")
    assert person.returncode == 0, person.stderr
    agent = person.stdout.strip()
    assert "has no NIP-OA tag" in person.stderr
    assert owner_tag_digest(agent, "").hex() in person.stderr
    assert f"buzz-broker agent attach-auth --agent {agent} --sig" in person.stderr
    held = cli("agent", "create", "--owner", agent, "--name", "for-an-agent")
    assert held.returncode == 0, held.stderr
    assert "NIP-OA" not in held.stderr and "sha256" not in held.stderr, held.stderr


def test_migrate_to_a_token_of_the_same_label_in_another_module_is_not_the_same_token(
        cli: Cli, tmp_path: Path) -> None:
    """A token is its module and its label: moving from SoftHSM's "buzz" to another
    module's "buzz" is a migration, not "the same token" (it goes on to open the target,
    which here does not exist)."""
    assert cli("keys", "init").returncode == 0
    other = tmp_path / "other.toml"
    other.write_text(f'[pkcs11]\nmodule = "{tmp_path / "libother-pkcs11.so"}"\n'
                     f'token_label = "{cli.token.label}"\npin_file = "{cli.token.pin_file}"\n')
    done = cli("keys", "migrate", "--to-config", str(other))
    assert done.returncode == 1
    assert "names the same token" not in done.stderr, done.stderr
