"""What docs/custodian.md promises of the custodian's own bounds, on a real custodian (real
token, its own process), asked straight over its socket as a compromised pipeline would:

- a per-agent token bucket of `signatures_per_minute`: past it, `rate_limited`, and for
  that agent only;
- `signed.jsonl` bounded by `log_max_bytes`, one older file kept, the chain going on
  across the move;
- an observer frame's (24200) and a memory event's (30174) `p` must name the signer's own
  recorded owner (and the frame's `agent` the signer itself);
- `max_records`: past it `mint` and `import` are refused, destroyed records counting.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from custody import KeyRecord, TokenConfig
from custody._records import OWNER_TAG_CONDITIONS
from custody.custodian import messages
from custody.custodian.client import CustodianClient, decode_reply
from custody.custodian.ledger import MAX_AGENTS, RateBound
from custody.custodian.verify import verify_chain
from custody.custodian.messages import MAX_RECORDS, record_obj
from tests.custodian.test_refusals import ask, held, human, intent, refused
from tests.fixtures.custodian import CustodianProcess, running_custodian

PER_MINUTE = 5
LOG_MAX_BYTES = 4096
RECORDS_HERE = 3


@pytest.fixture
def bounded(custody_state: tuple[TokenConfig, Path], local_relay: str,
            tmp_path: Path) -> Iterator[CustodianProcess]:
    """A custodian with small bounds (signatures, log, records), its log in `tmp_path`."""
    with running_custodian(custody_state, local_relay, tmp_path,
                           signatures_per_minute=PER_MINUTE,
                           settings={"log_dir": str(tmp_path / "log"),
                                     "log_max_bytes": LOG_MAX_BYTES,
                                     "max_records": RECORDS_HERE}) as process:
        yield process


def post(agent: str, n: int = 1) -> list[dict[str, object]]:
    return [intent(agent, 9, [["h", "chan"]], f"message {i}") for i in range(n)]


def rate_limited(answer: tuple[bool, object]) -> bool:
    ok, value = answer
    return not ok and isinstance(value, tuple) and value[0] == "rate_limited"


async def test_an_agent_past_its_bound_is_rate_limited_alone(bounded: CustodianProcess,
                                                             local_relay: str) -> None:
    client = await CustodianClient.open(bounded.socket)
    first, second = await held(client, human()), await held(client, human())
    ok, events = ask(bounded.socket, "sign", events=post(first, PER_MINUTE))
    assert ok and isinstance(events, list) and len(events) == PER_MINUTE
    assert rate_limited(ask(bounded.socket, "sign", events=post(first)))
    assert rate_limited(ask(bounded.socket, "sign_auth", agent=first,
                            relay_url=local_relay, challenge="c",
                            created_at=1_700_000_000))
    # another agent's bucket is its own; a batch larger than what is left is refused whole
    assert ask(bounded.socket, "sign", events=post(second))[0]
    assert rate_limited(ask(bounded.socket, "sign", events=post(second, PER_MINUTE)))
    await client.aclose()


async def test_a_mint_under_a_held_owner_is_a_signature_from_its_bound(
        bounded: CustodianProcess, tmp_path: Path) -> None:
    """The NIP-OA tag of a key minted under an owner held here is signed by the owner's key:
    that signature spends the owner's bound, and the log line names it."""
    client = await CustodianClient.open(bounded.socket)
    owner = await held(client, human())
    assert ask(bounded.socket, "sign", events=post(owner, PER_MINUTE - 1))[0]
    ok, minted = ask(bounded.socket, "mint", owner=owner, mint_ref=None)
    assert ok and isinstance(minted, dict) and minted["auth_tag"][1] == owner
    assert rate_limited(ask(bounded.socket, "mint", owner=owner, mint_ref=None))
    assert ask(bounded.socket, "mint", owner=human(), mint_ref=None)[0]  # no key held: free
    lines = [json.loads(line) for line in (tmp_path / "log" / "signed.jsonl").read_text()
             .splitlines()]
    assert [line.get("signed_by") for line in lines if line["op"] == "mint"] == [owner, None]
    await client.aclose()


async def test_the_log_keeps_one_older_file_and_its_chain_goes_on(
        bounded: CustodianProcess, tmp_path: Path) -> None:
    client = await CustodianClient.open(bounded.socket)
    agents = [await held(client, human()) for _ in range(RECORDS_HERE)]
    for round_ in range(PER_MINUTE):  # 15 signatures: the log moves once past 4 KiB
        for agent in agents:
            assert ask(bounded.socket, "sign", events=post(agent))[0], (round_, agent)
    await client.aclose()
    log = tmp_path / "log"
    assert sorted(p.name for p in log.glob("signed.jsonl*")) == ["signed.jsonl", "signed.jsonl.1"]
    older, current = log / "signed.jsonl.1", log / "signed.jsonl"
    older_lines = older.read_text().splitlines()
    # moved once past the bound: never more than the bound and the one line that passed it
    assert LOG_MAX_BYTES < older.stat().st_size <= LOG_MAX_BYTES + len(older_lines[-1]) + 1
    assert current.stat().st_size <= LOG_MAX_BYTES + 1024
    last = json.loads(older_lines[-1])
    assert verify_chain(older, start=json.loads(older_lines[0])["prev"]) == len(older_lines)
    assert verify_chain(current, start=last["hash"]) >= 1
    assert json.loads(current.read_text().splitlines()[0])["seq"] == last["seq"] + 1
    signed = [json.loads(line) for line in current.read_text().splitlines()]
    assert signed[-1]["op"] == "sign" and signed[-1]["agent"] == agents[-1]


async def test_observer_and_memory_events_name_the_signers_own_owner(
        bounded: CustodianProcess) -> None:
    client = await CustodianClient.open(bounded.socket)
    owner, stranger = human(), human()
    agent = await held(client, owner)
    other = await held(client, owner)

    def frame(p: str, about: str) -> dict[str, object]:
        return intent(agent, 24200, [["p", p], ["agent", about], ["frame", "telemetry"]], "x")

    def memory(p: str) -> dict[str, object]:
        return intent(agent, 30174, [["d", "a" * 64], ["p", p]], "x")

    assert ask(bounded.socket, "sign", events=[frame(owner, agent), memory(owner)])[0]
    for wrong in (frame(stranger, agent), frame(owner, other), memory(stranger),
                  memory(agent)):
        assert refused(ask(bounded.socket, "sign", events=[wrong])), wrong["tags"]
    await client.aclose()


def records_full(answer: tuple[bool, object]) -> bool:
    ok, value = answer
    return (not ok and isinstance(value, tuple) and value[0] == "custody"
            and "max_records" in value[1])


async def test_past_max_records_mint_and_import_are_refused(bounded: CustodianProcess) -> None:
    """A mint-destroy loop cannot grow the keystore, the grace copies or the `agents`
    answer without end: the bound counts destroyed records too."""
    client = await CustodianClient.open(bounded.socket)
    owner = human()
    first = await held(client, owner)
    for ref in ("m1", "m2"):
        assert ask(bounded.socket, "mint", owner=owner, mint_ref=ref)[0]
    assert records_full(ask(bounded.socket, "mint", owner=owner, mint_ref="m3"))
    # A retry of the mint that took the last place is no new record: its record again (a
    # mutation review: refused, the bound checked before the replay).
    ok, again = ask(bounded.socket, "mint", owner=owner, mint_ref="m2")
    assert ok and again["mint_ref"] == "m2", again  # type: ignore[index]
    assert ask(bounded.socket, "destroy", pubkey=first)[0]
    assert records_full(ask(bounded.socket, "mint", owner=owner, mint_ref="m4"))
    with pytest.raises(Exception, match="max_records"):
        await held(client, owner)
    ok, records = ask(bounded.socket, "agents", include_deleted=True)
    assert ok and isinstance(records, list) and len(records) == RECORDS_HERE
    await client.aclose()


def test_at_most_max_records_the_largest_records_fit_the_agents_answer() -> None:
    """`max_records` can go no higher than MAX_RECORDS, and that many records at the
    table's worst (a 512-character mint_ref JSON writes 6-fold, a tombstone, a NIP-OA
    tag) are one answer frame the pipeline's client reads, and a few more are not: the
    number is custody's (custody/_records.py, a restore's bound too), written once."""
    worst = KeyRecord(pubkey="f" * 64, owner="f" * 64, created_at=2**40, deleted_at=2**40,
                      mint_ref="\x1f" * 512,
                      auth_tag=("auth", "f" * 64, OWNER_TAG_CONDITIONS, "f" * 128))
    frame = messages.reply_ok([record_obj(worst)] * MAX_RECORDS)
    assert messages.frame_length(frame[:messages.HEADER.size]) == len(frame) - 4
    ok, records = decode_reply(frame[messages.HEADER.size:])
    assert ok and isinstance(records, list) and len(records) == MAX_RECORDS
    with pytest.raises(messages.BadMessage):  # and a few more would not fit
        messages.reply_ok([record_obj(worst)] * (MAX_RECORDS + 8))


def test_an_idle_agents_bucket_holds_one_minutes_burst_not_its_idle_time() -> None:
    """The bucket refills at `signatures_per_minute` up to that many: an hour idle gives
    one minute's signatures at once, not sixty."""
    now = [0.0]
    bound = RateBound(PER_MINUTE, clock=lambda: now[0])
    assert bound.take("a" * 64, PER_MINUTE)
    now[0] = 3600.0
    assert bound.take("a" * 64, PER_MINUTE)
    assert not bound.take("a" * 64, 1)


@pytest.mark.parametrize(("others", "dropped"), [(MAX_AGENTS - 1, False), (MAX_AGENTS, True)])
def test_at_most_max_agents_buckets_the_oldest_dropped(others: int, dropped: bool) -> None:
    """Memory holds MAX_AGENTS buckets: one more drops the least recently used, which only
    gives that agent a full bucket again (docs of custody/custodian/ledger.py)."""
    bound = RateBound(1, clock=lambda: 0.0)  # no refill: a spent bucket stays spent
    assert bound.take("a" * 64, 1)
    for n in range(others):
        assert bound.take(f"{n:064x}", 1)
    assert bound.take("a" * 64, 1) is dropped

