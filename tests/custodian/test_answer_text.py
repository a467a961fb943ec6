"""A custodian answer holding a lone surrogate (JSON spells one, "\\ud800"; it has no UTF-8
form) is a broken table to the pipeline's client, said at once as CustodianUnavailable,
never a value handed on to fail later, as a UnicodeEncodeError when the daemon writes it
to an agent. The peer is a small server answering every request with one fixed body: a
custodian of this build never sends one (its encoder writes UTF-8)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from custody.custodian import messages
from custody.custodian.client import CustodianClient, CustodianUnavailable
from tests.fixtures.custodian import answering_peer

PK = "ab" * 32
RECORD = ('{"pubkey":"%s","owner":"%s","auth_tag":null,"created_at":1,"deleted_at":null,'
          '"mint_ref":"ref@"}' % (PK, PK))


@pytest.fixture
def answering(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    path = tmp_path / "custodian.sock"
    with answering_peer(path, request.param):
        yield path


def _agents(escaped: str) -> bytes:
    return b'{"v":%d,"ok":[%s]}' % (messages.VERSION, RECORD.replace("@", escaped).encode())


@pytest.mark.parametrize("answering", [_agents("\\ud800"), _agents("\\udfff")],
                         indirect=True, ids=["high", "low"])
def test_a_lone_surrogate_in_an_answer_is_a_broken_table(answering: Path) -> None:
    client = CustodianClient(answering)
    try:
        with pytest.raises(CustodianUnavailable, match="broke the table"):
            client.lookup("agents", include_deleted=False)
    finally:
        client.close()


@pytest.mark.parametrize("answering", [_agents("\\ud83d\\ude00")], indirect=True, ids=["pair"])
def test_a_surrogate_pair_in_an_answer_is_text(answering: Path) -> None:
    client = CustodianClient(answering)
    try:
        (record,) = client.lookup("agents", include_deleted=False)  # type: ignore[misc]
    finally:
        client.close()
    assert record["mint_ref"] == "ref\U0001f600"
