"""The custodian refuses, when asked directly over its socket, what a compromised pipeline
might ask: a kind outside its list, an owner's record about another owner's agent, NIP-44
for a pair other than agent-owner, AUTH for another relay, a tag it adds itself, and any
peer of another uid (SO_PEERCRED). Each refusal is next to the allowed request it differs
from, so the test shows the line, not a custodian that refuses everything.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import coincurve
import pytest

from custody import Custody, TokenConfig
from custody.custodian import messages
from custody.custodian.client import CustodianClient, decode_reply, request
from tests.fixtures.custodian import CustodianProcess, write_custodian_config

NOBODY = 65534


def ask(path: Path, op: str, /, tail: bytes = b"", **args: object) -> tuple[bool, object]:
    """One request straight over the socket (`tail`: the raw bytes after the frame)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        try:
            sock.sendall(request(op, **args) + tail)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a refused peer is answered and closed at once: its answer is still there
        return _answer(sock)


def _answer(sock: socket.socket) -> tuple[bool, object]:
    data = b""
    while len(data) < 4 or len(data) < 4 + messages.frame_length(data[:4]):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return decode_reply(data[4:])


def human() -> str:
    return coincurve.PrivateKey().public_key_xonly.format().hex()


async def held(client: CustodianClient, owner: str) -> str:
    secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
    return (await client.import_agent(secret, owner=owner)).pubkey


def intent(signer: str, kind: int, tags: list[list[str]], content: str = "") -> dict[str, object]:
    return {"signer": signer, "kind": kind, "created_at": 1_700_000_000, "tags": tags,
            "content": content}


def refused(answer: tuple[bool, object]) -> bool:
    ok, value = answer
    return not ok and isinstance(value, tuple) and value[0] == "refused"


async def test_a_kind_outside_the_list_is_refused(custodian: CustodianProcess) -> None:
    client = await CustodianClient.open(custodian.socket)
    agent = await held(client, human())
    ok, _ = ask(custodian.socket, "sign", events=[intent(agent, 9, [["h", "chan"]], "hi")])
    assert ok
    for kind in (1, 4, 22242, 24133, 30078):
        assert refused(ask(custodian.socket, "sign", events=[intent(agent, kind, [], "x")])), kind
    # one bad intent refuses the whole batch: nothing of it is signed
    assert refused(ask(custodian.socket, "sign", events=[
        intent(agent, 9, [["h", "chan"]], "hi"), intent(agent, 1, [], "x")]))
    # the NIP-OA tag is the custodian's to add, never the caller's
    assert refused(ask(custodian.socket, "sign", events=[
        intent(agent, 9, [["h", "chan"], ["auth", agent, "", "00" * 64]], "hi")]))
    await client.aclose()


async def test_a_flood_of_refusals_costs_the_custodians_log_a_line(
        custodian: CustodianProcess) -> None:
    """A compromised pipeline may ask for what is refused as often as it likes: each was
    a warning on the custodian's stderr (its unit's journal, whose rate limit then drops
    the lines that matter, the unseal door's among them). One line a minute per row,
    with the count of those not written; every request is still answered refused."""
    client = await CustodianClient.open(custodian.socket)
    agent = await held(client, human())
    for _ in range(200):
        assert refused(ask(custodian.socket, "sign", events=[intent(agent, 1, [], "x")]))
    assert refused(ask(custodian.socket, "sign_auth", agent=agent,
                       relay_url="wss://relay.example", challenge="c", created_at=1_700_000_000))
    await client.aclose()
    lines = [line for line in custodian.stop().splitlines() if "custodian refused" in line]
    assert [line.split(":")[1].strip() for line in lines] == [
        "custodian refused sign", "custodian refused sign_auth"], lines


def test_a_flood_of_changes_costs_the_custodians_journal_no_line_each(
        custodian: CustodianProcess) -> None:
    """Each change is a line of the signed log; custody's own INFO line for each reached the
    unit's journal too, and only `sign` is rate-bounded, so a compromised pipeline minting
    and destroying (or swapping an agent's NIP-OA tag) at will pushed the journal past its
    rate limit, as refusals did (a red-team review: 800 lines a second). The custodian
    keeps custody's warnings, and its opening line, and drops its line per change."""
    for _ in range(50):
        ok, made = ask(custodian.socket, "mint", owner=human(), mint_ref=None)
        assert ok and ask(custodian.socket, "destroy", pubkey=made["pubkey"])[0]  # type: ignore[index]
    lines = custodian.stop().splitlines()
    assert not [line for line in lines if "minted" in line or "destroyed the key" in line], lines
    assert [line for line in lines if "custody open" in line], lines


async def test_a_30177_for_an_agent_of_another_owner_is_refused(
        custodian: CustodianProcess) -> None:
    client = await CustodianClient.open(custodian.socket)
    owner = await held(client, human())
    own = (await client.mint_agent(owner=owner, mint_ref="m1")).pubkey
    other_owner = await held(client, human())
    foreign = (await client.mint_agent(owner=other_owner, mint_ref="m2")).pubkey
    ok, _ = ask(custodian.socket, "sign", events=[intent(owner, 30177, [["d", own]], "{}")])
    assert ok
    assert refused(ask(custodian.socket, "sign",
                       events=[intent(owner, 30177, [["d", foreign]], "{}")]))
    # the same for the owner's deletion (kind 5) and put-user (9000) of a foreign agent
    assert refused(ask(custodian.socket, "sign", events=[intent(
        owner, 5, [["a", f"30177:{owner}:{foreign}"], ["k", "30177"]])]))
    assert refused(ask(custodian.socket, "sign", events=[intent(
        owner, 9000, [["h", "chan"], ["p", foreign], ["role", "bot"]])]))
    # and a put-user for its own agent with a role other than agents.create's
    assert ask(custodian.socket, "sign", events=[intent(
        owner, 9000, [["h", "chan"], ["p", own], ["role", "bot"]])])[0]
    assert refused(ask(custodian.socket, "sign", events=[intent(
        owner, 9000, [["h", "chan"], ["p", own], ["role", "admin"]])]))
    # and an agent cannot sign its owner's record about itself
    assert refused(ask(custodian.socket, "sign", events=[intent(own, 30177, [["d", own]], "{}")]))
    await client.aclose()


async def test_nip44_for_a_pair_other_than_agent_and_owner_is_refused(
        custodian: CustodianProcess) -> None:
    client = await CustodianClient.open(custodian.socket)
    owner = human()
    agent = await held(client, owner)
    plaintext = [messages.b64(b"memory")]
    ok, payloads = ask(custodian.socket, "encrypt", agent=agent, peer=owner, plaintexts=plaintext)
    assert ok and isinstance(payloads, list)
    stranger = human()
    assert refused(ask(custodian.socket, "encrypt", agent=agent, peer=stranger,
                       plaintexts=plaintext))
    assert refused(ask(custodian.socket, "decrypt", agent=agent, peer=stranger,
                       payloads=payloads))
    ok, opened = ask(custodian.socket, "decrypt", agent=agent, peer=owner, payloads=payloads)
    assert ok and opened == plaintext
    await client.aclose()


async def test_auth_is_signed_only_for_the_configured_relay(custodian: CustodianProcess,
                                                            local_relay: str) -> None:
    client = await CustodianClient.open(custodian.socket)
    agent = await held(client, human())
    ok, event = ask(custodian.socket, "sign_auth", agent=agent, relay_url=local_relay,
                    challenge="c", created_at=1_700_000_000)
    assert ok and isinstance(event, dict) and event["kind"] == 22242
    other = ask(custodian.socket, "sign_auth", agent=agent, relay_url="wss://relay.example",
                challenge="c", created_at=1_700_000_000)
    assert refused(other)
    # Both named: the operator whose two files disagree reads which is which.
    assert local_relay in str(other[1]) and "wss://relay.example" in str(other[1]), other
    # The URL asked is the pipeline's text, said in the journal: escaped, never a new line.
    forged = ask(custodian.socket, "sign_auth", agent=agent,
                 relay_url="wss://r\ncustodian: forged line\x1b[2J", challenge="c",
                 created_at=1_700_000_000)
    message = forged[1][1]  # type: ignore[index]
    assert refused(forged) and "\n" not in message and "\x1b" not in message, message
    await client.aclose()


@pytest.fixture
def open_socket_custodian(custody_state: tuple[TokenConfig, Path], local_relay: str,
                          tmp_path: Path) -> Iterator[CustodianProcess]:
    """A custodian whose socket file any uid may open (mode 0666, in a 0755 directory):
    the file mode is opened on purpose, so the peer-uid check is the only line left."""
    token, state_dir = custody_state
    where = Path(tempfile.mkdtemp(prefix="cust-"))
    where.chmod(0o755)
    sock = where / "c.sock"
    config = write_custodian_config(tmp_path / "custodian.toml", token=token,
                                    state_dir=state_dir, socket=sock, relay_url=local_relay)
    process = CustodianProcess(config, sock)
    process.start()
    sock.chmod(0o666)
    yield process
    process.stop()
    sock.unlink(missing_ok=True)
    where.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root (setuid)")
def test_a_peer_of_another_uid_is_refused(open_socket_custodian: CustodianProcess) -> None:
    path = open_socket_custodian.socket
    assert ask(path, "records_version")[0]  # the configured uid (this one) is answered
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another uid, then the same request
        code = 1
        try:
            os.close(read)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            ok, value = ask(path, "records_version")
            os.write(write, repr((ok, value)).encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001 - told to the parent
            os.write(write, repr(exc).encode())
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    seen = os.read(read, 4096).decode()
    os.close(read)
    assert os.WEXITSTATUS(status) == 0, seen
    assert seen == repr((False, ("refused", "peer uid refused")))


def test_past_max_connections_a_connection_is_refused(custodian: CustodianProcess) -> None:
    """The pipeline's client keeps a few connections: MAX_CONNECTIONS open at once is
    already a fault, and each one past them is answered `refused` and closed before a byte
    of it is read. Those held are still answered."""
    from custody.custodian.server import MAX_CONNECTIONS

    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(sock)
            sock.settimeout(10)
            sock.connect(str(custodian.socket))
            sock.sendall(request("records_version"))
            assert _answer(sock)[0]  # answered: the custodian counts it open
        assert ask(custodian.socket, "records_version") == (
            False, ("refused", "too many connections"))
        for sock in held:
            sock.sendall(request("records_version"))
            assert _answer(sock)[0]
    finally:
        for sock in held:
            sock.close()


async def test_a_fault_is_answered_internal_and_logged_by_its_type_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An exception other than custody's own is the custodian's fault: answered `internal`
    with a fixed message, and logged by its type's name only, since its text can carry an
    argument (a secret among them: it is not the custodian's code that raised it)."""
    import logging

    from custody.custodian.server import Custodian, Settings

    text = "nsec1-an-argument-in-the-text"

    class Faulty:
        def records_version(self) -> int:
            raise RuntimeError(text)

    custodian = Custodian(Faulty(), Settings(  # type: ignore[arg-type]
        socket=tmp_path / "unused.sock", pipeline_uid=os.getuid(), relay_url="wss://r.example",
        log_path=tmp_path / "log" / "signed.jsonl"))
    caplog.set_level(logging.INFO, logger="buzz_broker")
    frame = await custodian.answer(messages.Request("records_version", {}))
    custodian.log.close()
    assert decode_reply(frame[messages.HEADER.size:]) == (
        False, ("internal", "custodian fault"))
    assert [record.getMessage() for record in caplog.records] == [
        "custodian fault in records_version: RuntimeError (0 not logged)"]
    assert text not in caplog.text


async def test_a_destroyed_key_is_recoverable_within_the_grace_period(
        custodian: CustodianProcess) -> None:
    """A compromised pipeline's destroy is not key loss: the custodian kept the sealed copy,
    and the operator's `--recover` (under the custodian's uid, beside it) brings it back."""
    import subprocess
    import sys

    client = await CustodianClient.open(custodian.socket)
    agent = await held(client, human())
    ok, _ = ask(custodian.socket, "destroy", pubkey=agent)
    # Changes made past this client (another connection, another process) reach its copy
    # of the records within RECHECK_SECONDS; the test asks for them now instead of waiting.
    client.records.expire()
    assert ok and client.agent(agent) is None
    assert refused(ask(custodian.socket, "sign", events=[intent(agent, 9, [["h", "c"]], "x")]))
    done = subprocess.run([sys.executable, "-m", "custody.custodian", str(custodian.config),
                           "--recover", agent], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    client.records.expire()
    assert client.agent(agent) is not None
    ok, signed = ask(custodian.socket, "sign", events=[intent(agent, 9, [["h", "c"]], "x")])
    assert ok
    again = subprocess.run([sys.executable, "-m", "custody.custodian", str(custodian.config),
                            "--recover", agent], capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and f"agent {agent} is held: nothing to recover" in again.stderr
    await client.aclose()


async def test_an_import_under_an_agent_held_here_needs_that_owners_own_tag(
        custodian: CustodianProcess) -> None:
    """Whoever imports over the table knows the key's secret: a NIP-OA tag the custodian
    signed for it with a held owner's key would let that caller sign "owned by agent X"
    events anywhere. Refused without the owner's own tag; what stays allowed beside it: the
    owner's tag given, a mint under X (the custodian makes key and tag, nobody sees the
    secret), an import under a person, and one under an agent removed here."""
    from buzzwire.nostr import owner_tag_digest, verify_owner_tag

    client = await CustodianClient.open(custodian.socket)
    x_key = coincurve.PrivateKey()  # the test holds X's secret too, so it can make X's tag
    x = (await client.import_agent(bytearray(x_key.secret.hex().encode()), owner=human())).pubkey
    made_up = coincurve.PrivateKey()
    k = made_up.public_key_xonly.format().hex()

    def import_k(owner: str, auth_tag: list[str] | None) -> tuple[bool, object]:
        return ask(custodian.socket, "import", tail=made_up.secret.hex().encode(),
                   secret_bytes=64, owner=owner, auth_tag=auth_tag)

    answer = import_k(x, None)
    assert refused(answer) and "held (or destroyed) here" in str(answer[1]), answer
    assert ask(custodian.socket, "agent", pubkey=k, include_deleted=True) == (True, None)
    log = (custodian.config.parent / "state" / "custodian" / "signed.jsonl").read_text()
    assert k not in log
    # the owner's own tag: the custodian verifies it and stores it as given
    tag = ["auth", x, "", x_key.sign_schnorr(owner_tag_digest(k, "")).hex()]
    ok, record = import_k(x, tag)
    assert ok and record["auth_tag"] == tag, record  # type: ignore[index]
    # a mint under X still gets X's tag, signed here
    minted = await client.mint_agent(owner=x, mint_ref="under-x")
    assert minted.auth_tag is not None and minted.auth_tag[1] == x
    assert verify_owner_tag(minted.auth_tag, minted.pubkey)
    # an import under a person: no tag to sign, allowed
    person_owned = coincurve.PrivateKey()
    ok, record = ask(custodian.socket, "import", tail=person_owned.secret.hex().encode(),
                     secret_bytes=64, owner=human(), auth_tag=None)
    assert ok and record["auth_tag"] is None, record  # type: ignore[index]
    gone = await held(client, human())
    assert ask(custodian.socket, "destroy", pubkey=gone)[0]
    # under an agent destroyed here, refused as under a held one: `--recover` would bring
    # it back owning the import with no tag of its own, and sign its owner-only records
    under_gone = coincurve.PrivateKey()
    ok, refusal = ask(custodian.socket, "import", tail=under_gone.secret.hex().encode(),
                      secret_bytes=64, owner=gone, auth_tag=None)
    assert not ok and "held (or destroyed) here" in str(refusal), refusal
    await client.aclose()


async def test_the_facade_refuses_a_held_owner_inside_the_hop(custody: Custody) -> None:
    """The custodian's second line (HeldOwner.REFUSE, checked where the tag would be signed):
    its own check reads the records before the hop, and a `--recover` of the owner by another
    process could land in between. In-process (`HeldOwner.SIGN`, the default) the tag is
    still signed: there the importer can read the keys anyway."""
    from custody import CustodyError, HeldOwner

    x = (await custody.import_agent(bytearray(coincurve.PrivateKey().secret.hex().encode()),
                                    owner=human())).pubkey
    secret = coincurve.PrivateKey().secret.hex().encode()
    with pytest.raises(CustodyError, match="held here"):
        await custody.import_agent(bytearray(secret), owner=x, held_owner=HeldOwner.REFUSE)
    assert custody.agents() == [custody.agent(x)]
    record = await custody.import_agent(bytearray(secret), owner=x)
    assert record.auth_tag is not None and record.auth_tag[1] == x


async def test_an_intent_dated_more_than_an_hour_ahead_is_refused(
        custodian: CustodianProcess, local_relay: str) -> None:
    """A replaceable event dated far ahead (a profile, a memory record, an owner's 30177)
    would beat every later version on every relay: the custodian signs none more than
    MAX_FUTURE_SECONDS ahead of its clock, AUTH included; just inside the bound it signs."""
    import time

    from custody.custodian.intents import MAX_FUTURE_SECONDS

    client = await CustodianClient.open(custodian.socket)
    owner = human()
    agent = await held(client, owner)
    own = (await client.mint_agent(owner=agent, mint_ref="own")).pubkey  # `agent` signs its 30177
    late = int(time.time()) + MAX_FUTURE_SECONDS + 60
    near = int(time.time()) + MAX_FUTURE_SECONDS - 60
    for far in (late, 2**40):
        for item in (intent(agent, 0, [], "{}"), intent(own, 9, [["h", "c"]], "hi"),
                     intent(agent, 30177, [["d", own]], "{}"),
                     intent(agent, 30174, [["d", "x"], ["p", owner]], "e")):
            answer = ask(custodian.socket, "sign", events=[{**item, "created_at": far}])
            assert refused(answer) and "ahead" in str(answer[1]), (item["kind"], answer)
        assert refused(ask(custodian.socket, "sign_auth", agent=agent, relay_url=local_relay,
                           challenge="c", created_at=far))
    ok, signed = ask(custodian.socket, "sign", events=[{**intent(agent, 0, [], "{}"),
                                                        "created_at": near}])
    assert ok and signed[0]["created_at"] == near, signed  # type: ignore[index]
    ok, auth = ask(custodian.socket, "sign_auth", agent=agent, relay_url=local_relay,
                   challenge="c", created_at=near)
    assert ok, auth
    await client.aclose()


async def test_keys_not_held_here_spend_no_bucket_and_evict_none(custody: Custody,
                                                                tmp_path: Path) -> None:
    """`sign_auth` for MAX_AGENTS + 1 random keys, none held: each is `unknown_agent`, and
    the bucket of the agent that used up its bound stays used up (before: each random key
    got a bucket first, and the flood evicted that agent's, giving it a full one)."""
    import secrets

    from custody.custodian.ledger import MAX_AGENTS
    from custody.custodian.server import Custodian, Settings

    custodian = Custodian(custody, Settings(
        socket=tmp_path / "unused.sock", pipeline_uid=os.getuid(), relay_url="wss://r.example",
        log_path=tmp_path / "log" / "signed.jsonl", signatures_per_minute=1))
    agent = (await custody.import_agent(
        bytearray(coincurve.PrivateKey().secret.hex().encode()), owner=human())).pubkey

    async def auth(pubkey: str) -> str:
        """The answer's error code, or "ok"."""
        frame = await custodian.answer(messages.Request("sign_auth", {
            "agent": pubkey, "relay_url": "wss://r.example", "challenge": "c",
            "created_at": 1_700_000_000}))
        ok, value = decode_reply(frame[messages.HEADER.size:])
        return "ok" if ok else str(value[0])  # type: ignore[index]

    assert [await auth(agent), await auth(agent)] == ["ok", "rate_limited"]
    for _ in range(MAX_AGENTS + 1):
        assert await auth(secrets.token_hex(32)) == "unknown_agent"
    assert await auth(agent) == "rate_limited"
    custodian.log.close()


async def test_custodys_warnings_still_reach_the_custodians_journal(
        custodian: CustodianProcess, custody_state: tuple[TokenConfig, Path]) -> None:
    """Custody's logger is held at WARNING in the serving custodian to keep a line per
    change out of the journal; a warning still gets there: the unseal door's refusal of
    a blob swapped into another agent's row (what the security engineer looks for)."""
    _, state_dir = custody_state
    client = await CustodianClient.open(custodian.socket)
    owner = human()
    victim, donor = [await held(client, owner) for _ in range(2)]
    await client.aclose()
    with sqlite3.connect(state_dir / "keystore.db") as db:
        (blob,) = db.execute("SELECT sealed FROM keys WHERE pubkey = ?", (donor,)).fetchone()
        db.execute("UPDATE keys SET sealed = ? WHERE pubkey = ?", (blob, victim))
    ok, _ = ask(custodian.socket, "sign", events=[intent(victim, 9, [["h", "c"]])])
    assert not ok
    stderr = custodian.stop()
    assert f"unseal refused for agent {victim}" in stderr, stderr[-2000:]
