"""A custodian speaking another version of the message table (one not restarted after an
upgrade: docs/install.md 11 restarts it) is said as that, both versions named, not as a
broken table, which reads like tampering.

The peer is a small server here, a custodian of another build as far as the frames go: it
reads each request and answers as such a custodian answers a frame it cannot read, a
well-formed `bad_message` error in its own version. A custodian of this build cannot show
that fault, so no real one is started.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from custody.custodian import messages
from custody.custodian.client import CustodianClient, CustodianUnavailable, decode_reply
from tests.fixtures.custodian import answering_peer

#: A build's table version before this one, and one after.
OTHERS = (messages.VERSION - 1, messages.VERSION + 1)


@pytest.fixture(params=OTHERS, ids=lambda v: f"v{v}")
def other_build(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """The socket of a peer answering every request in table version `request.param`."""
    version: int = request.param
    path = tmp_path / "custodian.sock"
    answer = json.dumps({"v": version, "error": {
        "code": "bad_message", "message": f"not a version {version} message"}}).encode()
    with answering_peer(path, answer):
        yield path, version


def _said(version: int) -> str:
    return (f"the custodian speaks table version {version}, this build {messages.VERSION}: "
            "restart the custodian after an upgrade (docs/install.md, 11)")


def test_a_commands_lookup_names_both_versions(other_build: tuple[Path, int]) -> None:
    path, version = other_build
    client = CustodianClient(path)
    try:
        with pytest.raises(CustodianUnavailable) as raised:
            client.lookup("records_version")
    finally:
        client.close()
    assert str(raised.value) == _said(version)


async def test_the_daemons_first_snapshot_names_both_versions(
        other_build: tuple[Path, int]) -> None:
    """What the daemon's start asks first (`CustodianClient.open`, daemon/wiring.py, which
    prefixes the custodian's socket to this line)."""
    path, version = other_build
    with pytest.raises(CustodianUnavailable) as raised:
        await CustodianClient.open(path)
    assert str(raised.value) == _said(version)


@pytest.mark.parametrize("v", [True, "3", None])
def test_a_version_that_is_no_integer_still_breaks_the_table(v: object) -> None:
    body = json.dumps({"v": v, "ok": 0}).encode()
    with pytest.raises(messages.BadMessage) as raised:
        decode_reply(body)
    assert not isinstance(raised.value, messages.OtherVersion)


def test_the_upgrade_table_states_this_builds_version() -> None:
    """docs/install.md 11's table of state formats gives the message table's version: the
    one this build speaks (it said 3 after the `token` row made it 4)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "install.md").read_text()
    row = next(line for line in text.splitlines()
               if line.startswith("| the custodian's message table"))
    assert f'`"v"` {messages.VERSION} in every frame' in row
