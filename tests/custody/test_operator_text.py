"""Issue 22 M3: agent-chosen text reaches the operator's terminal only escaped.

A name can enter a store without the contract's checks (a restored backup, a directory
written by hand, a record from before the rule), so every CLI output of it and every log
line goes through `buzzwire.contract.printable` / `printable_json`. Each test scans the
bytes a terminal would receive for the characters a terminal acts on.
"""

from __future__ import annotations

import io
import json
import logging
import re
import sqlite3
import subprocess

import pytest

from daemon.log import log_event, setup_logging
from tests.backup.test_backup import Host, age_identity
from tests.custody._secrets import PUB_1, PUB_2, SECRET_1
from tests.custody.test_cli import BUZZ_BROKER
from tests.fixtures.token import SoftHsmToken
from tests.json_lines import json_lines

#: The issue's name: sets the window title, erases the line, returns to column 0.
HOSTILE = "\x1b]0;owned\x07\x1b[2K\rBob"
#: and the 8-bit forms (CSI, OSC 52 clipboard write, ST), a bidi override, a line separator.
HOSTILE_C1 = "\x9b2J\x9d52;c;b3duZWQ=\x9c\u202eboB\u2028"
#: What must never be written raw: C0 (but the newline that ends each line), DEL, C1, the
#: line separators, the bidi embeddings/overrides/isolates.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _raw_in(text: str) -> list[str]:
    return RAW.findall(text)


def _name_directly(host: Host, pubkey: str, name: str) -> None:
    """Write `name` into directory.db as a hand edit (or an older version) would."""
    db = sqlite3.connect(host.cli.state / "directory.db")
    try:
        with db:
            db.execute("UPDATE names SET name = ? WHERE pubkey = ?", (name, pubkey))
            assert db.total_changes == 1
    finally:
        db.close()


def test_agent_list_escapes_a_name_written_into_the_directory(softhsm_token: SoftHsmToken,
                                                              tmp_path) -> None:  # type: ignore[no-untyped-def]
    host = Host(softhsm_token, tmp_path / "host")
    assert host("agent", "import", "--owner", PUB_2, "--name", "plain", stdin=SECRET_1).returncode == 0
    _name_directly(host, PUB_1, HOSTILE + HOSTILE_C1)

    table = host("agent", "list")
    assert table.returncode == 0 and PUB_1 in table.stdout
    assert _raw_in(table.stdout + table.stderr) == []
    assert "\\x1b]0;owned\\x07\\x1b[2K\\x0dBob" in table.stdout  # shown, not acted on
    listed = host("agent", "list", "--json")
    assert _raw_in(listed.stdout) == []
    # The JSON is the same value: a script reading it gets the stored name exactly.
    assert json_lines(listed.stdout)[0]["name"] == HOSTILE + HOSTILE_C1
    for done in (host("status"), host("status", "--json")):
        assert _raw_in(done.stdout + done.stderr) == []


def test_a_restored_backups_names_are_escaped(softhsm_token: SoftHsmToken, tmp_path) -> None:  # type: ignore[no-untyped-def]
    source = Host(softhsm_token, tmp_path / "source")
    assert source("agent", "import", "--owner", PUB_2, "--name", "x", stdin=SECRET_1).returncode == 0
    _name_directly(source, PUB_1, HOSTILE_C1 + HOSTILE)
    identity, out = tmp_path / "identity.txt", tmp_path / "agents.age"
    backed = source("keys", "backup", "--recipient", age_identity(identity), "--out", str(out))
    assert backed.returncode == 0, backed.stderr

    target = Host(softhsm_token, tmp_path / "target")
    restored = target("keys", "restore", "--identity", str(identity), str(out), "--yes")
    assert restored.returncode == 0, restored.stderr
    assert PUB_1 in restored.stdout and _raw_in(restored.stdout + restored.stderr) == []
    listed = target("agent", "list")
    assert PUB_1 in listed.stdout and _raw_in(listed.stdout + listed.stderr) == []
    assert json_lines(target("agent", "list", "--json").stdout)[0]["name"] == HOSTILE_C1 + HOSTILE


@pytest.mark.token_independent
def test_a_cli_fault_line_is_escaped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A fault line quotes what it names (here a config path); the terminal gets it escaped.
    done = subprocess.run([str(BUZZ_BROKER), "--config", str(tmp_path / HOSTILE), "status"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "\\x1b]0;owned" in done.stderr and _raw_in(done.stdout + done.stderr) == []


@pytest.mark.token_independent
def test_log_lines_escape_agent_and_relay_text() -> None:
    stream = io.StringIO()
    setup_logging("info", stream=stream, environ={})
    logger = logging.getLogger("buzz_broker.test_operator_text")
    log_event(logger, "relay_notice", notice=HOSTILE + HOSTILE_C1, name=HOSTILE_C1)
    logger.info("plain logging call with %s", HOSTILE_C1)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and _raw_in(stream.getvalue()) == []
    first = json.loads(lines[0])
    assert (first["notice"], first["name"]) == (HOSTILE + HOSTILE_C1, HOSTILE_C1)
    assert json.loads(lines[1])["message"].endswith(HOSTILE_C1)
