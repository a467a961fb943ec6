"""One JSON convention for every `--json` command (issue 25 item 5; docs/operations.md,
"JSON output"): JSON lines, one object per line, one line per item of a list.

`JSON_COMMANDS` is the one table: each command that takes `--json`, and how many lines it
prints. A test walks the real argument parser, so a new `--json` flag without a row fails;
another runs every row against a running broker (the real token and relay) and reads its
output strictly.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import trio

from daemon import cli
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.token import REPO
from tests.json_lines import json_lines

BUZZ_BROKER = REPO / ".venv" / "bin" / "buzz-broker"

#: Lines the broker must print for a row: for a list, one per item the harness knows of.
Expected = Callable[[BrokerHarness], int]

#: command words -> how many JSON lines its `--json` prints (the row's rule).
JSON_COMMANDS: dict[tuple[str, ...], Expected] = {
    ("agent", "list"): lambda b: len(b.app.directory.agents(include_deleted=False)),
    ("credential", "list"): lambda b: len(b.issued),
    ("audit", "show"): lambda b: -1,  # one per stored record: at least one, checked below
    ("status",): lambda b: 1,  # one report, one line
}


def _json_flags(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> set[tuple[str, ...]]:
    found = {words} if any("--json" in a.option_strings for a in parser._actions) else set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= _json_flags(sub, (*words, name))
    return found


def test_the_table_names_every_command_that_takes_json() -> None:
    found: set[tuple[str, ...]] = set()
    for command in cli.COMMANDS:
        # Only the selected command's arguments are built (its module imported), as in main.
        root = cli._parser(command)
        [commands] = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
        found |= _json_flags(commands.choices[command], (command,))
    assert found == set(JSON_COMMANDS)


def test_operations_md_documents_exactly_these_commands() -> None:
    text = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    section = text.split("## JSON output: every `--json` command", 1)[1].split("\n## ", 1)[0]
    rows = {tuple(m.group(1).split()) for m in re.finditer(r"^\| `([a-z ]+) --json` \|", section, re.M)}
    assert rows == set(JSON_COMMANDS)


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUZZ_BROKER), "--config", str(config), *args],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ))


async def test_every_json_command_prints_one_object_per_line(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agents = [await broker.human_owned_agent(f"json-{n}") for n in range(2)]
    credentials = [broker.credential(agent, [channel]) for agent in agents]
    for credential in credentials:  # audit records to show (a read is only counted)
        answer = await broker.call(credential, "message.post",
                                   {"channelId": channel, "content": "json lines"})
        assert answer["status"] == "succeeded", answer

    for words, expected in JSON_COMMANDS.items():
        done = await trio.to_thread.run_sync(lambda: _cli(broker.config_path, *words, "--json"))
        assert "Traceback" not in done.stderr, done.stderr
        # status exits 3 here (the in-process daemon holds no run lock): the form is the point.
        assert done.returncode in (0, 1, 3), (words, done.returncode, done.stderr)
        objects = json_lines(done.stdout)  # every line one JSON object, or it fails here
        want = expected(broker)
        if want < 0:
            assert len(objects) >= 1, words
        else:
            assert len(objects) == want, (words, done.stdout[:500])
        # Compact: no line is a fragment of a pretty-printed object.
        assert all(line.startswith("{") and line.endswith("}")
                   for line in done.stdout.splitlines()), words
