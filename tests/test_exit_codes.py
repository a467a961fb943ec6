"""docs/operations.md "Exit codes: every command" against the commands' own constants.

Every `EXIT_*` a command module defines has its row (under the command's name; the entry
point's under "every command"), and every row names a code a constant defines, or one the
entry point returns by rule (1 for a CliError, 130 for Ctrl-C). `custodian` hands its
words to the custodian's own entry point, whose modules (`CUSTODIAN`) define its codes."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

from custody import TokenConfig
from daemon import cli
from tests.custody._secrets import PUB_2, PUB_3, SECRET_1
from tests.fixtures.broker import write_config

REPO = Path(__file__).resolve().parent.parent
EVERY = "every command"
#: Codes the entry point gives by rule rather than by a named constant.
BY_RULE = {(EVERY, 0), (EVERY, 1), (EVERY, 130)}
#: The custodian's command line (custody/custodian/main.py) and the module of the one
#: form with a code of its own (`--verify-log`).
CUSTODIAN = ("custody.custodian.main", "custody.custodian.verify")


def _table() -> set[tuple[str, int]]:
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("## Exit codes: every command", 1)[1].split("\n## ", 1)[0]
    return {(m.group(1), int(m.group(2)))
            for m in re.finditer(r"^\| ([a-z -]+) \| (\d+) \|", section, re.M)}


def _constants() -> set[tuple[str, int]]:
    found = {(EVERY, value) for name, value in vars(cli).items()
             if name.startswith("EXIT_") and isinstance(value, int)}
    for command, (module_name, _help) in cli.COMMANDS.items():
        module = importlib.import_module(f"daemon.cli.{module_name}")
        found |= {(command, value) for name, value in vars(module).items()
                  if name.startswith("EXIT_") and isinstance(value, int)}
    for module_name in CUSTODIAN:
        found |= {("custodian", value) for name, value in
                  vars(importlib.import_module(module_name)).items()
                  if name.startswith("EXIT_") and isinstance(value, int)}
    return found


def test_every_exit_code_a_command_defines_is_in_the_table_and_no_other() -> None:
    table, constants = _table(), _constants()
    assert constants - table == set(), "codes with no row in docs/operations.md"
    assert table - constants - BY_RULE == set(), "rows that no command returns"


#: A malformed argument of the daemon's own commands, one per row: (words after `buzz-broker
#: --config FILE`, with AGENT, CRED for a live agent and an active credential, and what the
#: line names). Everything else on the row is valid, so the one malformed word is what is
#: refused. Before, each of these exited 1, the code of a fault, where the table says 2.
CHANNEL = "123e4567-e89b-12d3-a456-426614174000"
ISSUE = ("credential", "issue", "--agent", "AGENT", "--channel", CHANNEL, "--uid", "1000")
MALFORMED: tuple[tuple[tuple[str, ...], str], ...] = (
    ((*ISSUE[:5], "not-a-uuid", *ISSUE[6:], "--all-actions"), "--channel"),
    ((*ISSUE, "--all-actions", "--ttl", "30x"), "--ttl"),
    ((*ISSUE, "--action", "typo.set"), "--action"),
    ((*ISSUE[:3], "xyz", *ISSUE[4:], "--all-actions"), "--agent"),
    ((*ISSUE[:-1], "99999999999", "--all-actions"), "--uid"),
    ((*ISSUE, "--all-actions", "--label", "two\nlines"), "--label"),
    ((*ISSUE, "--all-actions", "--rate", "message.post=lots"), "--rate"),
    (("credential", "grant", "CRED", "--action", "typo.set"), "--action"),
    (("credential", "grant", "not-an-id", "--all-actions"), "credential id"),
    (("credential", "revoke", "not-an-id"), "credential id"),
    (("agent", "create", "--owner", "XYZ", "--name", "x"), "--owner"),
    (("agent", "create", "--owner", "b" * 64, "--name", "x"), "not a secp256k1"),
    (("agent", "create", "--owner", "AGENT", "--name", ""), "--name"),
    (("agent", "import", "--owner", "AGENT", "--auth-tag", "[1,"), "--auth-tag"),
    (("agent", "name", "XYZ", "scout"), "PUBKEY"),
    (("agent", "name", "AGENT", "two\nlines"), "NAME"),
    (("agent", "remove", "XYZ", "--yes"), "PUBKEY"),
    (("agent", "forget", "AGENT", "XYZ"), "key 2 named is not a pubkey"),
    (("agent", "attach-auth", "--agent", "xyz", "--sig", "ab" * 64), "--agent"),
    (("agent", "attach-auth", "--agent", "AGENT", "--sig", "zz"), "--sig"),
    (("agent", "attach-auth", "--agent", "AGENT", "--tag", "{"), "--tag"),
    (("audit", "show", "--since", "yesterday"), "bad time"),
    (("audit", "show", "--agent", "xyz"), "--agent"),
    (("audit", "show", "--credential", "cred_XYZ"), "--credential"),
    (("audit", "show", "--action", "typo.set"), "--action"),
    (("keys", "backup", "--recipient", "not-age", "--out", "OUT"), "--recipient 1"),
    (("keys", "rotate", "--new-kek-label", ""), "--new-kek-label"),
)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_malformed_argument_is_a_usage_error_and_changes_nothing(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    """docs/operations.md's "every command | 2" row, for every malformed argument of the
    daemon's own commands: exit 2, one `buzz-broker:` line naming the argument, nothing
    on stdout, nothing in the state directory changed (a live agent and an active
    credential there). A well-formed argument that what is held refuses stays 1 (last)."""
    token, state = custody_state
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                          socket=tmp_path / "b.sock", relay_url="ws://127.0.0.1:1")
    made = _cli(config, "agent", "create", "--owner", PUB_2, "--name", "held")
    assert made.returncode == 0, made.stderr
    agent = made.stdout.strip()
    issued = _cli(config, *[agent if w == "AGENT" else w for w in ISSUE], "--all-actions")
    assert issued.returncode == 0, issued.stderr
    cred = issued.stderr.split("issued ", 1)[1].split()[0]
    names = {"AGENT": agent, "CRED": cred, "OUT": str(tmp_path / "backup.age")}
    before = _snapshot(tmp_path)

    for words, named in MALFORMED:
        argv = [names.get(w, w) for w in words]
        done = _cli(config, *argv, stdin=SECRET_1)
        assert (done.returncode, done.stdout) == (2, ""), (argv, done.returncode, done.stderr)
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("buzz-broker: "), (argv, lines)
        assert named in lines[0], (argv, named, lines[0])
        assert _snapshot(tmp_path) == before, argv

    for words in (("agent", "remove", PUB_3, "--yes"), ("agent", "forget", PUB_3),
                  ("credential", "revoke", "cred_" + "0" * 16)):
        refused = _cli(config, *words)
        assert refused.returncode == 1, (words, refused.stderr)  # unknown here: state's


def _cli(config: Path, *argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BUZZ_BROKER_CONFIG"}
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(config), *argv],
                          cwd=REPO, env=env, input=stdin, capture_output=True, text=True,
                          timeout=60)
