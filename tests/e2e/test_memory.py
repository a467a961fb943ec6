"""storage.put and storage.get (NIP-BA Memory, NIP-AE) through the daemon.

- On a real relay (nostr-sdk's LocalRelay): put then get round-trips; the stored event is
  kind 30174 with exactly `d` and `p` tags, no slug in the clear, and nostr-sdk decrypts it
  with the owner's key to exactly NIP-BA's body; a second put is strictly later; a
  missing record is `{}`; the compact-body bound is exact at 65,535 bytes; an owner reads
  every length up to it with nostr-sdk.
- On tests/scripted_relay.py (an archival relay that also serves what a replacing relay
  would have dropped, and a hostile one): head selection among rival and malformed heads,
  the tombstone, the clock-poisoned head, versions by another key at the agent's address
  (never the head, never what a put is dated after), a version a relay files under another
  address (its first `d`), the query itself (`#p` the owner, `limit` 64), a relay replaying
  more versions than MAX_CANDIDATES (that many decrypted, no more), and a relay that
  cannot be read (`failed`, never `{}`).
- Without a relay: the clock-poison edge to the second (docs/protocol.md), and an agent
  custody stopped holding after authentication (`action_failed`).
"""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace
from typing import Any

import nostr_sdk
import pytest
import trio

from buzzwire.contract import ErrorCode, StoragePutArgs
from buzzwire.nostr import SignedEvent
from daemon.operations._base import OperationRefused
from daemon.operations._memory import (
    CLOCK_POISON_SECONDS, MAX_CANDIDATES, address_of, write_created_at,
)
from tests.adversarial.test_relay_substitution import Rig, rig  # noqa: F401 - the fixture
from tests.custody._secrets import PUB_2, SECRET_2, SECRET_X
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import TestKey, nostr_fetch, nostr_verify

KIND = 30174
OWNER_SDK = nostr_sdk.SecretKey.parse(SECRET_2)


def _succeeded(envelope: dict[str, Any], action: str) -> dict[str, Any]:
    assert envelope["status"] == "succeeded", json.dumps(envelope)[:400]
    assert envelope["action"] == action
    return dict(envelope["outcome"])


async def _agent(h: BrokerHarness) -> tuple[str, str]:
    """SECRET_X's agent, owned by PUB_2 (whose secret the test holds, as the owner does)."""
    agent = await h.hold(bytearray(SECRET_X.encode()), owner=PUB_2, name="memo")
    return agent, h.credential(agent, [str(uuid.uuid4())])


def _owner_reads(agent: str, content: str) -> str:
    return str(nostr_sdk.nip44_decrypt(OWNER_SDK, nostr_sdk.PublicKey.parse(agent), content))


async def _d_tag(h: BrokerHarness, cred: str, slug: str) -> str:
    return str(_succeeded(await h.call(cred, "storage.address", {"slug": slug}),
                          "storage.address")["dTag"])


async def test_put_then_get_round_trips_and_the_owner_decrypts(broker: BrokerHarness) -> None:
    agent, cred = await _agent(broker)
    value = 'line one\nline "two" é 🐝 / \\ \u0001'
    put = _succeeded(await broker.call(cred, "storage.put", {"slug": "mem/notes/a", "value": value}),
                     "storage.put")
    assert put["kind"] == KIND
    got = _succeeded(await broker.call(cred, "storage.get", {"slug": "mem/notes/a"}), "storage.get")
    assert got == {"value": value}

    d = await _d_tag(broker, cred, "mem/notes/a")
    [event] = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, [{"ids": [put["eventId"]]}])
    assert nostr_verify(event) and event["pubkey"] == agent and event["kind"] == KIND
    assert event["created_at"] == put["createdAt"]
    assert event["tags"] == [["d", d], ["p", PUB_2]]
    assert "mem/notes/a" not in json.dumps(event)
    body = _owner_reads(agent, event["content"])
    assert body.encode() == StoragePutArgs(slug="mem/notes/a", value=value).body()
    assert json.loads(body) == {"slug": "mem/notes/a", "value": value}

    # A second version is strictly later (NIP-AE's monotonic rule), and is the one read.
    again = _succeeded(await broker.call(cred, "storage.put", {"slug": "mem/notes/a", "value": "v2"}),
                       "storage.put")
    assert again["createdAt"] > put["createdAt"]
    assert _succeeded(await broker.call(cred, "storage.get", {"slug": "mem/notes/a"}),
                      "storage.get") == {"value": "v2"}


async def test_core_holds_the_profile_and_missing_records_are_empty(broker: BrokerHarness) -> None:
    agent, cred = await _agent(broker)
    # (Each test's agent is new to the relay only by its key: SECRET_X's records may remain
    # from an earlier test on the shared relay, so this asserts nothing about core before.)
    put = _succeeded(await broker.call(cred, "storage.put", {"slug": "core", "value": "# Me\n"}),
                     "storage.put")
    assert _succeeded(await broker.call(cred, "storage.get", {"slug": "core"}),
                      "storage.get") == {"value": "# Me\n"}
    [event] = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, [{"ids": [put["eventId"]]}])
    assert _owner_reads(agent, event["content"]) == '{"slug":"core","profile":"# Me\\n"}'
    assert _succeeded(await broker.call(cred, "storage.get", {"slug": "mem/never"}),
                      "storage.get") == {}


def _value_for_body(slug: str, body_bytes: int) -> str:
    overhead = len(StoragePutArgs(slug=slug, value="x").body()) - 1
    return "x" * (body_bytes - overhead)


async def test_a_large_body_the_relay_holds_is_read_by_the_owner(broker: BrokerHarness) -> None:
    agent, cred = await _agent(broker)
    value = _value_for_body("mem/big", 40_000)  # padded to 40,960: a 55 KB event
    put = _succeeded(await broker.call(cred, "storage.put", {"slug": "mem/big", "value": value}),
                     "storage.put")
    [event] = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, [{"ids": [put["eventId"]]}])
    assert len(_owner_reads(agent, event["content"]).encode()) == 40_000
    assert _succeeded(await broker.call(cred, "storage.get", {"slug": "mem/big"}),
                      "storage.get") == {"value": value}


@pytest.mark.parametrize("body_bytes", [65_408, 65_409, 65_535])
async def test_the_rust_nostr_band_is_accepted_and_the_relay_decides(
    broker: BrokerHarness, body_bytes: int
) -> None:
    """NIP-BA allows a 65,535-byte body and rust-nostr decrypts every one of them
    (tests/custody/test_nip44.py `test_the_rust_nostr_band`), so the host accepts the band.
    Its ciphertext makes an event of about 88 KB: a relay that caps events at 64 KiB (the
    test relay, nostr-sdk's default) refuses it, and the agent is told `failed` +
    `action_failed` with the relay's reason; nothing was stored."""
    _agent_pk, cred = await _agent(broker)
    slug = f"mem/band-{body_bytes}"  # the test relay outlives one test: a slug of its own
    value = _value_for_body(slug, body_bytes)
    refused = await broker.call(cred, "storage.put", {"slug": slug, "value": value})
    assert (refused["status"], refused["error"]["code"]) == ("failed", "action_failed")
    assert "size" in refused["error"]["message"]
    assert _succeeded(await broker.call(cred, "storage.get", {"slug": slug}), "storage.get") == {}


async def test_a_body_over_65535_compact_bytes_is_invalid(broker: BrokerHarness) -> None:
    _agent_pk, cred = await _agent(broker)
    too_long = _value_for_body("mem/big", 65_536)
    refused = await broker.call(cred, "storage.put", {"slug": "mem/big", "value": too_long})
    assert (refused["status"], refused["error"]["code"]) == ("failed", "invalid_request")
    # Escapes count: 13,107 controls are 65,535 bytes as `\u0001` each, far under as raw.
    controls = "\u0001" * 13_107
    refused = await broker.call(cred, "storage.put", {"slug": "mem/big", "value": controls})
    assert refused["error"]["code"] == "invalid_request"
    for blank in ("", "  \n\t"):
        refused = await broker.call(cred, "storage.put", {"slug": "mem/big", "value": blank})
        assert refused["error"]["code"] == "invalid_request"


# --- rival and malformed heads, on a relay that serves them all --------------------------

AGENT_KEY = TestKey(bytes.fromhex(SECRET_X))


def _version(created_at: int, body: str | bytes, *, d: str, tags: list[list[str]] | None = None,
             payload: str | None = None) -> dict[str, Any]:
    """A version signed by the agent's own key elsewhere (its runtime, Buzz Desktop)."""
    text = body if isinstance(body, str) else body.decode()
    content = payload if payload is not None else str(nostr_sdk.nip44_encrypt(
        nostr_sdk.SecretKey.parse(SECRET_X), nostr_sdk.PublicKey.parse(PUB_2), text,
        nostr_sdk.Nip44Version.V2))
    return AGENT_KEY.sign(KIND, content, tags if tags is not None else [["d", d], ["p", PUB_2]],
                          created_at)


async def _memo_in(rig: Rig) -> tuple[str, str, str]:
    h = rig.harness
    agent = await h.hold(bytearray(SECRET_X.encode()), owner=PUB_2, name="memo")
    cred = h.credential(agent, [str(uuid.uuid4())])
    return agent, cred, await _d_tag(h, cred, "mem/x")


def _stranger_payload() -> str:
    return str(nostr_sdk.nip44_encrypt(nostr_sdk.SecretKey.parse("0" * 63 + "3"),
                                       nostr_sdk.PublicKey.parse(AGENT_KEY.pubkey),
                                       '{"slug":"mem/x","value":"forged"}',
                                       nostr_sdk.Nip44Version.V2))


async def test_head_selection_among_rival_and_malformed_heads(rig: Rig) -> None:
    _agent_pk, cred, d = await _memo_in(rig)
    t = 1_700_000_000
    good = lambda at, v: _version(at, json.dumps({"slug": "mem/x", "value": v}), d=d)  # noqa: E731
    tie_a, tie_b = good(t + 5, "tie-a"), good(t + 5, "tie-b")
    winner = min(tie_a, tie_b, key=lambda e: e["id"])
    versions = [
        good(t, "old"),
        tie_a, tie_b,  # equal created_at: the lowest id wins
        # newer, each invalid for one NIP-AE rule, so none may be the head:
        _version(t + 9, '{"slug":"mem/x","value":"dup","value":"twin"}', d=d),  # duplicate member
        _version(t + 9, '{"slug":"mem/y","value":"other slug"}', d=d),  # re-derives elsewhere
        _version(t + 9, '{"slug":"mem/x","profile":"wrong shape"}', d=d),  # no value
        _version(t + 9, '{"slug":"mem/x","value":7}', d=d),  # value not a string
        _version(t + 9, '["slug","mem/x"]', d=d),  # not an object
        _version(t + 9, "not json", d=d),
        _version(t + 9, "", d=d, payload="AgAAAA=="),  # not a payload
        _version(t + 9, "", d=d, payload=_stranger_payload()),  # another pair's key
        _version(t + 9, '{"slug":"mem/x","value":"two d"}', d=d,
                 tags=[["d", d], ["d", d], ["p", PUB_2]]),
        _version(t + 9, '{"slug":"mem/x","value":"two p"}', d=d,
                 tags=[["d", d], ["p", PUB_2], ["p", PUB_2]]),
        _version(t + 9, '{"slug":"mem/x","value":"no p"}', d=d, tags=[["d", d]]),
        _version(t + 9, '{"slug":"mem/x","value":"p not the owner"}', d=d,
                 tags=[["d", d], ["p", TestKey().pubkey]]),
        # NaN and Infinity are no JSON (rule 3), even in a member readers ignore:
        _version(t + 9, '{"slug":"mem/x","value":"NaN aside","n":NaN}', d=d),
        _version(t + 9, '{"slug":"mem/x","value":"Infinity aside","n":[1,{"m":Infinity}]}', d=d),
        _version(t + 9, '{"slug":"mem/x","value":"-Infinity aside","n":-Infinity}', d=d),
        {**_version(t + 9, '{"slug":"mem/x","value":"bad sig"}', d=d), "sig": "00" * 64},
        TestKey().sign(KIND, "x", [["d", d], ["p", PUB_2]], t + 9),  # another author
    ]
    for event in versions:
        rig.serve(event)
    got = _succeeded(await rig.harness.call(cred, "storage.get", {"slug": "mem/x"}), "storage.get")
    assert got == {"value": "tie-b" if winner is tie_b else "tie-a"}

    # Unknown members are tolerated: a newer body with extra fields is the head.
    rig.serve(_version(t + 20, '{"future":{"a":[1,2]},"slug":"mem/x","value":"extra ok"}', d=d))
    got = _succeeded(await rig.harness.call(cred, "storage.get", {"slug": "mem/x"}), "storage.get")
    assert got == {"value": "extra ok"}

    # A put is later than every signed version there, valid or not (NIP-AE monotonic rule).
    put = _succeeded(await rig.harness.call(cred, "storage.put", {"slug": "mem/x", "value": "new"}),
                     "storage.put")
    assert put["createdAt"] >= max(int(time.time()), t + 21)


async def test_a_put_is_later_than_a_malformed_version_the_relay_files_at_the_address(
        rig: Rig) -> None:
    """A relay files an addressable event by kind, author and first `d` tag: a version with
    a second `p` tag is invalid for NIP-AE but still the address's newest there, so a put
    dated below it would be kept under it. The put is dated after it."""
    _agent_pk, cred, d = await _memo_in(rig)
    ahead = int(time.time()) + 300  # within the clock-poison bound
    rig.serve(_version(ahead, '{"slug":"mem/x","value":"two p"}', d=d,
                       tags=[["d", d], ["p", PUB_2], ["p", PUB_2]]))
    put = _succeeded(await rig.harness.call(cred, "storage.put", {"slug": "mem/x", "value": "new"}),
                     "storage.put")
    assert put["createdAt"] == ahead + 1


async def test_the_query_names_the_owner_and_the_decrypt_bound(rig: Rig) -> None:
    """NIP-AE's query, as the module doc has it: kinds, authors, `#d`, `#p` the owner, and
    the decrypt bound (64) as its `limit`, so an honest relay returns only versions
    encrypted to the owner, and no more of them than are decrypted."""
    agent, cred, d = await _memo_in(rig)
    before = len(rig.relay.received)
    _succeeded(await rig.harness.call(cred, "storage.get", {"slug": "mem/x"}), "storage.get")
    filters = [f for m in rig.relay.received[before:] if m[0] == "REQ" for f in m[2:]]
    assert {"kinds": [KIND], "authors": [agent], "#d": [d], "#p": [PUB_2],
            "limit": 64} in filters, filters


async def test_a_tombstone_head_is_empty_and_an_empty_string_is_kept(rig: Rig) -> None:
    _agent_pk, cred, d = await _memo_in(rig)
    t = 1_700_000_000
    rig.serve(_version(t, '{"slug":"mem/x","value":"alive"}', d=d))
    rig.serve(_version(t + 1, '{"slug":"mem/x","value":null}', d=d))
    assert _succeeded(await rig.harness.call(cred, "storage.get", {"slug": "mem/x"}),
                      "storage.get") == {}
    rig.serve(_version(t + 2, '{"slug":"mem/x","value":""}', d=d))
    assert _succeeded(await rig.harness.call(cred, "storage.get", {"slug": "mem/x"}),
                      "storage.get") == {"value": ""}


async def test_a_clock_poisoned_head_is_refused_not_overwritten(rig: Rig) -> None:
    _agent_pk, cred, d = await _memo_in(rig)
    rig.serve(_version(int(time.time()) + 86_400, '{"slug":"mem/x","value":"from the future"}', d=d))
    # Reading still answers with it (NIP-AE's head is the greatest created_at)...
    assert _succeeded(await rig.harness.call(cred, "storage.get", {"slug": "mem/x"}),
                      "storage.get") == {"value": "from the future"}
    # ...but writing above it would publish a day ahead: refused, nothing published.
    before = len([m for m in rig.relay.received if m[0] == "EVENT"])
    refused = await rig.harness.call(cred, "storage.put", {"slug": "mem/x", "value": "now"})
    assert (refused["status"], refused["error"]["code"]) == ("failed", "action_failed")
    assert len([m for m in rig.relay.received if m[0] == "EVENT"]) == before


#: Any fixed "now": write_created_at is given the host's clock.
NOW = 1_800_000_000


def _head_at(created_at: int) -> SignedEvent:
    return SignedEvent.from_json_obj(AGENT_KEY.sign(KIND, "x", [["d", "ab" * 32], ["p", PUB_2]],
                                                    created_at))


@pytest.mark.parametrize(("ahead", "dated"), [(0, NOW + 1), (898, NOW + 899), (899, NOW + 900)])
def test_a_put_may_be_dated_up_to_900_s_ahead(ahead: int, dated: int) -> None:
    # docs/protocol.md "Clock-poisoned head": a put is dated its head + 1, up to 900 s ahead.
    assert write_created_at(NOW, [_head_at(NOW + ahead)]) == dated


@pytest.mark.parametrize("ahead", [900, 901, 86_400])
def test_a_put_that_would_be_dated_more_than_900_s_ahead_is_refused(ahead: int) -> None:
    # The exact edge of the rule above: a head 900 s ahead would date the put 901 s ahead,
    # so it is refused (the e2e test shows a day ahead only).
    with pytest.raises(OperationRefused) as refused:
        write_created_at(NOW, [_head_at(NOW + ahead)])
    assert refused.value.code is ErrorCode.ACTION_FAILED


def test_the_documented_threshold_and_decrypt_bound_are_the_constants() -> None:
    # docs/protocol.md publishes both as this host's own numbers; the tests here read
    # MAX_CANDIDATES from the code, so only this holds the code to what is published.
    from tests.docs.snippets import REPO

    text = " ".join((REPO / "docs" / "protocol.md").read_text().split())
    assert "dated 900 s (15 minutes) or more ahead" in text and CLOCK_POISON_SECONDS == 900
    assert "At most 64 versions are decrypted per read" in text and MAX_CANDIDATES == 64


async def test_an_agent_removed_after_authentication_is_action_failed() -> None:
    """Custody no longer holding the agent (removed between admission and execution) is a
    refusal that says nothing happened, `action_failed`, never an internal fault."""
    async def memory_address(agent: str, slug: str) -> Any:
        return SimpleNamespace(d_tag="ab" * 32)

    ctx: Any = SimpleNamespace(
        principal=SimpleNamespace(agent=AGENT_KEY.pubkey),
        custody=SimpleNamespace(agent=lambda _agent: None, memory_address=memory_address))
    with pytest.raises(OperationRefused) as refused:
        await address_of(ctx, "mem/x")
    assert refused.value.code is ErrorCode.ACTION_FAILED


async def test_an_unreadable_relay_is_failed_never_empty(rig: Rig) -> None:
    from dataclasses import replace

    from tests.scripted_relay import ReqReply

    _agent_pk, cred, _d = await _memo_in(rig)
    rig.relay.script = replace(rig.relay.script, default_req=ReqReply.RESTRICTED)
    for action, args in (("storage.get", {"slug": "mem/x"}),
                         ("storage.put", {"slug": "mem/x", "value": "v"})):
        answer = await rig.harness.call(cred, action, args)
        assert (answer["status"], answer["error"]["code"]) == ("failed", "action_failed"), action


async def test_a_relay_replaying_every_version_costs_at_most_max_candidates_decrypts(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay that ignores the query's `limit` and serves every version of the record
    (one more than MAX_CANDIDATES, each valid) gets one custody decrypt per candidate kept,
    the newest MAX_CANDIDATES, not one per version it sent; the head is still the newest."""
    from daemon.operations._memory import MAX_CANDIDATES

    _agent_pk, cred, d = await _memo_in(rig)
    t = 1_700_000_000
    for n in range(MAX_CANDIDATES + 1):
        rig.serve(_version(t + n, json.dumps({"slug": "mem/x", "value": f"v{n}"}), d=d))
    custody = type(rig.harness.custody)
    decrypted: list[int] = []
    real_decrypt = custody.decrypt_from_owner_pair

    async def counting(self: Any, agent: str, payloads: Any) -> Any:
        decrypted.append(len(payloads))
        return await real_decrypt(self, agent, payloads)

    monkeypatch.setattr(custody, "decrypt_from_owner_pair", counting)
    got = _succeeded(await rig.harness.call(cred, "storage.get", {"slug": "mem/x"}), "storage.get")
    assert got == {"value": f"v{MAX_CANDIDATES}"}
    assert decrypted == [MAX_CANDIDATES]


def _signed_by(secret: str, created_at: int, body: str, *, d: str) -> dict[str, Any]:
    """A version at the agent's address by another key: `secret`'s, NIP-44 to the agent."""
    content = str(nostr_sdk.nip44_encrypt(nostr_sdk.SecretKey.parse(secret),
                                          nostr_sdk.PublicKey.parse(AGENT_KEY.pubkey), body,
                                          nostr_sdk.Nip44Version.V2))
    return TestKey(bytes.fromhex(secret)).sign(KIND, content, [["d", d], ["p", PUB_2]],
                                               created_at)


async def test_another_authors_future_version_at_the_address_does_not_block_a_put(
        rig: Rig) -> None:
    """A relay that serves, at the agent's address, an event by another key dated a day
    ahead: a relay files it under that author, not the agent, so it is no version of the
    record. The put is neither refused as clock-poisoned nor dated after it."""
    _agent_pk, cred, d = await _memo_in(rig)
    ahead = int(time.time()) + 86_400
    rig.serve(TestKey().sign(KIND, "x", [["d", d], ["p", PUB_2]], ahead))
    put = _succeeded(await rig.harness.call(cred, "storage.put", {"slug": "mem/x", "value": "new"}),
                     "storage.put")
    assert put["createdAt"] < ahead


async def test_a_version_filed_under_another_first_d_does_not_block_a_put(rig: Rig) -> None:
    """Its second `d` tag is this address, so it matches the query's `#d`, but a relay files
    an addressable event by its first `d`: it is another record's version. A day ahead, it
    neither makes the put clock-poisoned nor dates it."""
    _agent_pk, cred, d = await _memo_in(rig)
    ahead = int(time.time()) + 86_400
    rig.serve(_version(ahead, '{"slug":"mem/x","value":"elsewhere"}', d=d,
                       tags=[["d", "cd" * 32], ["d", d], ["p", PUB_2]]))
    put = _succeeded(await rig.harness.call(cred, "storage.put", {"slug": "mem/x", "value": "new"}),
                     "storage.put")
    assert put["createdAt"] < ahead


async def test_a_version_the_owner_signs_at_the_address_is_never_the_head(rig: Rig) -> None:
    """The owner holds the pair's key too, so a body it writes decrypts and is valid in
    every rule but the author's (NIP-AE rule 1: pubkey the agent). Newer than the agent's
    own version, it is still not the head, and a put is not dated after it."""
    _agent_pk, cred, d = await _memo_in(rig)
    rig.serve(_version(1_700_000_000, '{"slug":"mem/x","value":"mine"}', d=d))
    ahead = int(time.time()) + 300  # within the clock-poison bound
    rig.serve(_signed_by(SECRET_2, ahead, '{"slug":"mem/x","value":"the owner\'s"}', d=d))
    got = _succeeded(await rig.harness.call(cred, "storage.get", {"slug": "mem/x"}), "storage.get")
    assert got == {"value": "mine"}
    put = _succeeded(await rig.harness.call(cred, "storage.put", {"slug": "mem/x", "value": "new"}),
                     "storage.put")
    assert put["createdAt"] < ahead


async def test_the_protocol_examples_run_as_written(broker: BrokerHarness) -> None:
    """docs/protocol.md's storage.put and storage.get examples, sent byte for byte."""
    from tests.docs.snippets import REPO, blocks

    examples = {label: body.strip().encode() for lang, label, body in
                blocks(REPO / "docs" / "protocol.md") if lang == "json" and label}
    agent = await broker.human_owned_agent("protocol-memory")
    cred = broker.credential(agent, [str(uuid.uuid4())])
    for action in ("storage.put", "storage.get"):
        status, answer = await broker.post(examples[f"request-{action}"], cred)
        expected = json.loads(examples[f"response-{action}"])
        assert status == 200 and answer is not None
        assert (answer["status"], answer["action"], answer["requestId"]) == (
            expected["status"], action, expected["requestId"])
        if action == "storage.get":
            assert answer["outcome"] == expected["outcome"]
        else:
            assert set(answer["outcome"]) == set(expected["outcome"])
            assert answer["outcome"]["kind"] == expected["outcome"]["kind"]


async def test_buzz_broker_call_puts_and_gets(broker: BrokerHarness, tmp_path: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`buzz-broker call` speaks both actions through the agent client (exit 0, the
    host's envelope on stdout)."""
    from daemon import cli

    agent = await broker.human_owned_agent("cli-memory")
    path = tmp_path / "credential"
    path.write_text(broker.credential(agent, [str(uuid.uuid4())]) + "\n")
    path.chmod(0o400)

    def call(action: str, args: dict[str, str]) -> tuple[int, dict[str, Any]]:
        code = cli.main(["--config", str(broker.config_path), "call", action, "--args",
                         json.dumps(args), "--socket", str(broker.socket),
                         "--credential-file", str(path)])
        out = capsys.readouterr().out
        return code, json.loads(out) if out.strip() else {}

    code, put = await trio.to_thread.run_sync(call, "storage.put", {"slug": "mem/cli", "value": "by hand"})
    assert code == 0 and put["outcome"]["kind"] == KIND
    code, got = await trio.to_thread.run_sync(call, "storage.get", {"slug": "mem/cli"})
    assert code == 0 and got["outcome"] == {"value": "by hand"}
    code, _bad = await trio.to_thread.run_sync(call, "storage.put", {"slug": "mem/cli", "value": " "})
    assert code == 2  # usage: the client refuses a blank value before sending


async def test_a_sealed_verdict_opens_only_in_custody_for_its_agent(broker: BrokerHarness) -> None:
    from daemon.pipeline import sealed_verdict

    agent, _cred = await _agent(broker)
    other = await broker.human_owned_agent("other")
    response = json.dumps({"outcome": {"value": "sealed plaintext " + "é" * 70_000}},
                          ensure_ascii=False).encode()  # more than one NIP-44 chunk
    stored = await sealed_verdict.seal(broker.custody, agent, response)
    assert sealed_verdict.is_sealed(stored) and b"sealed plaintext" not in stored
    assert stored.count(b"\n") == 2  # three payloads
    assert await sealed_verdict.unseal(broker.custody, agent, stored) == response
    # The owner can open it too (the pair's key), as it can every memory record.
    for payload in stored[1:].decode().split("\n"):
        assert _owner_reads(agent, payload)
    assert await sealed_verdict.unseal(broker.custody, other, stored) is None
    tampered = stored[:-5] + (b"AAAA=" if stored[-5:] != b"AAAA=" else b"BBBB=")
    assert await sealed_verdict.unseal(broker.custody, agent, tampered) is None
    assert await sealed_verdict.unseal(broker.custody, agent, b"\x01\xff") is None


async def test_audit_lines_carry_the_d_tag_never_the_slug(broker: BrokerHarness) -> None:
    from daemon.state.audit import AUDIT_DIRNAME, verify

    _agent_pk, cred = await _agent(broker)
    slug = "mem/audited/private-slug-name"
    put = _succeeded(await broker.call(cred, "storage.put", {"slug": slug, "value": "v"}),
                     "storage.put")
    _succeeded(await broker.call(cred, "storage.get", {"slug": slug}), "storage.get")
    d = await _d_tag(broker, cred, slug)
    await broker.app.reads.flush(everything=True)  # the storage.get's count (issue 24)
    audit_dir = broker.state_dir / AUDIT_DIRNAME
    assert verify(audit_dir).ok  # the chain still verifies with the new member
    lines = [json.loads(line) for path in sorted(audit_dir.iterdir()) if path.is_file()
             for line in path.read_text().splitlines() if line.startswith("{")]
    memory = [ln for ln in lines if ln.get("action") in ("storage.put", "storage.get")]
    assert {(ln["action"], ln["phase"]) for ln in memory} >= {
        ("storage.put", "intent"), ("storage.put", "verdict"), ("storage.get", "reads")}
    # A read is counted under its d tag (the count's target), a put's lines carry it.
    assert all(ln["dTag"] == d for ln in memory if ln["phase"] != "reads")
    assert all(ln["targets"] == {d: 1} for ln in memory if ln["phase"] == "reads")
    assert any(put["eventId"] in ln["events"] for ln in memory)
    assert all("dTag" not in ln for ln in lines if ln.get("action") not in
               ("storage.put", "storage.get"))
    for path in audit_dir.iterdir():
        if path.is_file():
            assert slug.encode() not in path.read_bytes()


async def test_the_audit_log_alone_confirms_no_guessed_memory_value(
        broker: BrokerHarness) -> None:
    """A reviewer's attack, kept: whoever reads only the audit files (shipped to collectors,
    copied into backups) rebuilds candidate bodies byte for byte with the client's `freeze`
    and the requestId the line carries in clear. Against an unkeyed `bodySha256` it
    recovered ("mem/bank", "card PIN 4821") in 0.6 s; against `bodyMac` no line equals any
    candidate's digest, and the true body's sha256 is nowhere in the audit directory.
    Only the host's key (`<state>/audit-mac.key`, never under audit/) confirms a body."""
    import hashlib
    import hmac

    from buzz_broker_client import AsyncBrokerClient, Succeeded
    from buzzwire.contract import encode_request
    from daemon.state.audit import AUDIT_DIRNAME

    slug, value = "mem/bank", "card PIN 4821"  # what an agent remembers for its owner
    _agent_pk, cred = await _agent(broker)
    client = AsyncBrokerClient(str(broker.socket), cred)
    assert isinstance(await client.storage_put(slug, value), Succeeded)

    # --- the attacker: the audit directory's bytes, nothing else -------------------------
    audit_dir = broker.state_dir / AUDIT_DIRNAME
    written = b"".join(p.read_bytes() for p in sorted(audit_dir.rglob("*")) if p.is_file())
    puts = [ln for ln in map(json.loads, written.splitlines())
            if ln.get("action") == "storage.put"]
    assert {ln["phase"] for ln in puts} == {"intent", "verdict"}
    [request_id] = {ln["requestId"] for ln in puts}

    def body(guess_slug: str, guess: str) -> bytes:
        return encode_request(client.freeze("storage.put", {"slug": guess_slug, "value": guess},
                                            request_id=request_id))

    truth = hashlib.sha256(body(slug, value)).hexdigest()
    guesses = {hashlib.sha256(body(s, f"card PIN {n:04d}")).hexdigest()
               for s in ("core", "mem/notes", "mem/bank", "mem/home") for n in range(10_000)}
    assert truth in guesses  # the dictionary holds the answer: a miss below means something
    confirmed = [(ln["phase"], name) for ln in puts for name, member in ln.items()
                 if isinstance(member, str) and member in guesses]
    assert confirmed == [], confirmed
    assert truth.encode() not in written

    # --- the host, holding its key, does confirm it (the line does name this body) ---------
    from daemon.state.audit_mac import KEY_FILE_NAME

    key = (broker.state_dir / KEY_FILE_NAME).read_bytes()
    assert {ln["bodyMac"] for ln in puts} == {
        hmac.new(key, body(slug, value), hashlib.sha256).hexdigest()}
    assert not any(p.name == KEY_FILE_NAME for p in audit_dir.rglob("*"))
