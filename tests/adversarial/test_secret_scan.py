"""Secret scan (issue 8 item 5): one scenario that uses every secret, then a search of all it produced.

Invariant: after the daemon has run every operation, refused every kind of bad input,
raised on bad key material, and the operator CLI has imported, issued, listed and called,
none of the secrets involved appears, in any spelling (hex lower/upper, `nsec1`, raw bytes,
half a key), in: the HTTP responses, the log records, the process's captured stdout/stderr,
the CLI transcripts, the exception texts, the files of the state directory and the token,
or the events the relay holds.

Secrets in play: a memory record's value and slug (storage.put/get: the value is allowed
only in the answers that return it; the ledger keeps the storage.get verdict sealed),
the token's user and SO PINs, three agent secret keys imported (one by
hex, one by nsec, one through the CLI), one deliberately invalid secret, every bearer
credential issued (in-process and by the CLI), and the host's two MAC keys (read cursors,
audit bodies).

Designated holders are exempt for their own secret only: the PIN files hold the PINs, the
`credential issue` stdout and the agent's credential file carry that one token, and each
MAC key file holds its MAC key. Positive controls check the scan finds a secret where it
must be, so an empty result means something.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import coincurve
import nostr_sdk
import pytest
import trio

from custody import CustodyError
from buzzwire.contract import read_request
from tests.adversarial import tally
from tests.adversarial._secrets import Secret, SecretScan, files_under, key_secret, raw_secret, text_secret
from tests.fixtures.broker import BrokerHarness, raw_post, request_body
from tests.fixtures.observer import OwnerWatch, decrypt
from tests.fixtures.relay import TestKey, nostr_fetch
from tests.fixtures.token import REPO, SoftHsmToken

BUZZ_BROKER = REPO / ".venv" / "bin" / "buzz-broker"
TOKEN_PREFIX = "bzb_"


#: Memory plaintexts the scan looks for (both >= 16 bytes, distinctive).
MEMORY_VALUE = "the owner's private note: door code 7391-alpha-kestrel"
MEMORY_SLUG = "mem/scan/private-slug-kestrel"


def _new_secret_hex() -> str:
    return coincurve.PrivateKey().secret.hex()


def _pubkey_of(secret_hex: str) -> str:
    return coincurve.PrivateKey(bytes.fromhex(secret_hex)).public_key_xonly.format().hex()


class Scenario:
    """Collects every byte the scenario produced, labelled by where it came from."""

    def __init__(self, broker: BrokerHarness, scan: SecretScan) -> None:
        self.broker = broker
        self.scan = scan
        self.outputs: list[tuple[str, bytes, frozenset[str]]] = []

    def keep(self, where: str, blob: bytes | str, allowed: frozenset[str] = frozenset()) -> None:
        data = blob.encode("utf-8", "surrogatepass") if isinstance(blob, str) else blob
        self.outputs.append((where, data, allowed))

    async def post(self, body: bytes, credential: str | None,
                   headers: tuple[tuple[str, str], ...] = ()) -> tuple[int, dict[str, Any] | None]:
        status, raw = await raw_post(self.broker.socket, body, credential, headers)
        self.keep(f"HTTP {status} response", raw)
        return status, (json.loads(raw) if raw else None)

    async def call(self, credential: str, action: str, args: dict[str, Any]) -> dict[str, Any]:
        status, envelope = await self.post(request_body(action, args), credential)
        assert status == 200 and envelope is not None, (action, status)
        return envelope

    async def cli(self, *args: str, stdin: str = "", allowed: frozenset[str] = frozenset()
                  ) -> subprocess.CompletedProcess[str]:
        # In a thread: the daemon answering `call` runs on this very event loop.
        done = await trio.to_thread.run_sync(lambda: subprocess.run(
            [str(BUZZ_BROKER), "--config", str(self.broker.config_path), *args],
            input=stdin, capture_output=True, text=True, timeout=60, env=dict(os.environ),
        ))
        self.keep(f"CLI {args[0]} {args[1] if len(args) > 1 else ''} stdout", done.stdout, allowed)
        self.keep(f"CLI {args[0]} {args[1] if len(args) > 1 else ''} stderr", done.stderr)
        assert "Traceback" not in done.stderr
        return done


def _ok(envelope: dict[str, Any]) -> dict[str, Any]:
    assert envelope["status"] == "succeeded", envelope.get("error")
    return dict(envelope["outcome"])


def _code(envelope: dict[str, Any]) -> str:
    assert envelope["status"] == "failed"
    return str(envelope["error"]["code"])


async def test_no_secret_leaks_anywhere(broker: BrokerHarness, softhsm_token: SoftHsmToken,
                                        caplog: pytest.LogCaptureFixture,
                                        capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    caplog.set_level(logging.DEBUG)
    scan = SecretScan()
    run = Scenario(broker, scan)
    user_pin = Path(softhsm_token.pin_file).read_text().strip()
    so_pin = Path(softhsm_token.so_pin_file).read_text().strip()
    scan.add(text_secret("token user PIN", user_pin))
    scan.add(text_secret("token SO PIN", so_pin))

    # --- agents imported with secrets the test knows (hex, and nsec) ---------------------
    channel, other_channel = str(uuid.uuid4()), str(uuid.uuid4())
    owner = coincurve.PrivateKey().public_key_xonly.format().hex()
    hex_secret, nsec_secret = _new_secret_hex(), _new_secret_hex()
    scan.add(key_secret("agent A secret", hex_secret))
    scan.add(key_secret("agent B secret", nsec_secret))
    agent_a = (await broker.custody.import_agent(bytearray(hex_secret.encode()), owner=owner)).pubkey
    nsec_text = nostr_sdk.SecretKey.parse(nsec_secret).to_bech32()
    agent_b = (await broker.custody.import_agent(bytearray(nsec_text.encode()), owner=owner)).pubkey
    assert (agent_a, agent_b) == (_pubkey_of(hex_secret), _pubkey_of(nsec_secret))
    cred_a = broker.credential(agent_a, [channel])
    cred_b = broker.credential(agent_b, [channel, other_channel])

    # --- every operation -------------------------------------------------------------------
    first = _ok(await run.call(cred_a, "message.post", {"channelId": channel, "content": "one"}))
    _ok(await run.call(cred_b, "message.post", {"channelId": channel, "content": "two",
                                                 "mentions": [agent_a]}))
    _ok(await run.call(cred_b, "message.reply", {"channelId": channel,
                                                  "replyToEventId": first["eventId"], "content": "r"}))
    _ok(await run.call(cred_a, "reaction.add", {"channelId": channel,
                                                 "targetEventId": first["eventId"], "reaction": "+"}))
    _ok(await run.call(cred_a, "profile.set", {"displayName": "Alpha", "about": "scans"}))
    _ok(await run.call(cred_a, "storage.address", {"slug": "mem/scan"}))
    # Memory (issue 23): the value is a secret everywhere but in the answers that return it;
    # the slug too (NIP-AE keeps it out of the clear: tags, audit, ledger, logs).
    scan.add(text_secret("memory value", MEMORY_VALUE))
    scan.add(text_secret("memory slug", MEMORY_SLUG))
    _ok(await run.call(cred_a, "storage.put", {"slug": MEMORY_SLUG, "value": MEMORY_VALUE}))
    get_body = request_body("storage.get", {"slug": MEMORY_SLUG})
    # The identical retry runs again: no retry storage holds the value (issue 24).
    for attempt in ("first", "retry"):
        status, raw = await raw_post(broker.socket, get_body, cred_a)
        run.keep(f"HTTP {status} storage.get ({attempt})", raw, frozenset({"memory value"}))
        got = json.loads(raw)
        assert got["outcome"] == {"value": MEMORY_VALUE}, attempt
        assert "replayed" not in got, attempt
    page = _ok(await run.call(cred_a, "channel.read", {"channelId": channel, "limit": 1}))
    assert "nextCursor" in page  # the MAC key was used
    _ok(await run.call(cred_a, "channel.read", {"channelId": channel, "limit": 1,
                                                 "cursor": page["nextCursor"]}))
    _ok(await run.call(cred_a, "channel.read", {"channelId": channel, "mentionsOnly": True}))
    created = _ok(await run.call(cred_a, "agents.create", {
        "channelId": channel, "displayName": "Minted", "systemPrompt": "p"}))
    _ok(await run.call(cred_a, "agents.update", {"target": {"name": "Minted"},
                                                  "displayName": "Minted 2", "systemPrompt": "p"}))
    _ok(await run.call(cred_a, "agents.delete", {"target": {"pubkey": created["agentPubkey"]}}))
    _ok(await run.call(cred_a, "presence.set", {"status": "online"}))
    _ok(await run.call(cred_b, "typing.set", {"channelId": other_channel}))

    # --- observer.emit and liveness.ping: an observer payload's plaintext is a secret ------
    # (NIP-BA: plaintext at the broker boundary, protected in logs and retry storage).
    watcher = TestKey()
    observed = (await broker.custody.import_agent(
        bytearray(_new_secret_hex().encode()), owner=watcher.pubkey)).pubkey
    cred_d = broker.credential(observed, [channel])
    payload_secret = "observer-plaintext-" + uuid.uuid4().hex
    scan.add(text_secret("observer payload", payload_secret))
    frames = [{"kind": "acp_read", "payload": json.dumps({"thought": payload_secret})},
              {"kind": "turn_started", "payload": payload_secret}]
    async with OwnerWatch(broker.relay_url, watcher, want=len(frames)) as watch:
        emit_body = request_body("observer.emit", {"frames": frames}, request_id="scan-observer")
        status, emitted = await run.post(emit_body, cred_d)
        assert emitted is not None and emitted["outcome"] == {"accepted": 2}, emitted
        status, replay = await run.post(emit_body, cred_d)  # the stored verdict, replayed
        assert replay is not None and replay.get("replayed") is True
        telemetry = await watch.collected()
    assert len(telemetry) == len(frames)
    run.keep("relay observer events", json.dumps(telemetry))
    # Positive control: the owner's key opens them, and the scan sees the plaintext there.
    assert any(scan.contains(json.dumps(decrypt(watcher, e)), "observer payload") for e in telemetry)
    for bad in ({"frames": [{"kind": "k", "payload": payload_secret, "note": payload_secret}]},
                {"frames": [{"kind": " ", "payload": payload_secret}]},
                {"frames": [{"kind": payload_secret * 10, "payload": "p"}]}):
        assert _code(await run.call(cred_d, "observer.emit", bad)) == "invalid_request"
    assert _code(await run.call(cred_d, "liveness.ping", {
        "channelId": channel, "turnId": payload_secret})) == "unsupported"

    # The cursor MAC key exists now; it is a secret too, and so is the audit MAC key
    # (with it a body is confirmed against the audit log's bodyMac).
    mac_key_path = broker.state_dir / "cursor-mac.key"
    scan.add(raw_secret("cursor MAC key", mac_key_path.read_bytes()))
    audit_key_path = broker.state_dir / "audit-mac.key"
    scan.add(raw_secret("audit MAC key", audit_key_path.read_bytes()))

    # --- bad inputs, each answered without echoing what it carried ------------------------
    wrong = cred_a[:-1] + ("A" if cred_a[-1] != "A" else "B")
    assert _code(await run.call(wrong, "channel.read", {"channelId": channel})) == "unauthenticated"
    status, env = await run.post(request_body("channel.read", {"channelId": channel}), cred_a,
                                 headers=(("Authorization", f"Bearer {cred_b}"),))
    assert status == 200 and env is not None and _code(env) == "unauthenticated"
    status, env = await run.post(request_body("channel.read", {"channelId": channel}), None,
                                 headers=(("Authorization", f"Basic {cred_a}"),))
    assert status == 200 and env is not None and _code(env) == "unauthenticated"
    # Secrets smuggled into argument slots and unknown members: refused, never quoted back.
    for args in ({"channelId": cred_a}, {"channelId": channel, "pin": user_pin},
                 {"channelId": channel, cred_a: 1}, {"channelId": channel, user_pin: {"a": None}},
                 {"channelId": channel, "cursor": hex_secret}, {"channelId": nsec_text}):
        assert _code(await run.call(cred_a, "channel.read", args)) == "invalid_request"
    assert _code(await run.call(cred_a, "storage.address", {"slug": nsec_text + " x"})) == "invalid_request"
    assert _code(await run.call(cred_a, "presence.set", {"status": user_pin})) == "invalid_request"
    assert _code(await run.call(cred_a, "typing.set", {"channelId": hex_secret})) == "invalid_request"
    assert _code(await run.call(cred_a, "message.post", {"channelId": other_channel,
                                                          "content": "x"})) == "unauthorized"
    status, env = await run.post(b'{"requestId":"' + cred_a.encode() + b'",', cred_a)
    assert (status, env) == (400, None)
    reading = read_request(b'{"requestId":"r","pin":"' + user_pin.encode() + b'","pin":1}')
    assert reading.error is not None
    run.keep("ContractError text", f"{reading.error}{reading.error!r}{reading.error.detail}"
                                   f"{reading.error.message}")

    # --- key material the custody refuses: the exception text must not quote it ----------
    invalid = "ff" * 32  # above the curve order: not a secret key
    scan.add(Secret("invalid secret", (invalid.encode(), invalid.upper().encode())))
    near_nsec = nsec_text[:-1] + ("q" if nsec_text[-1] != "q" else "p")  # checksum broken
    for candidate in (invalid, invalid.upper(), hex_secret[:-2], near_nsec, hex_secret):
        with pytest.raises((CustodyError, ValueError)) as raised:
            await broker.custody.import_agent(bytearray(candidate.encode()), owner=owner)
        run.keep("CustodyError text", f"{raised.value}{raised.value!r}{raised.value.args}")

    # --- the operator CLI, as a subprocess, against the running daemon's state -----------
    cli_secret = _new_secret_hex()
    scan.add(key_secret("agent C secret (CLI import)", cli_secret))
    done = await run.cli("agent", "import", "--owner", owner, "--name", "gamma", stdin=cli_secret + "\n")
    assert done.returncode == 0 and done.stdout.strip() == _pubkey_of(cli_secret)
    agent_c = done.stdout.strip()
    assert (await run.cli("agent", "import", "--owner", owner, stdin=cli_secret[:40] + "\n")).returncode != 0
    assert (await run.cli("agent", "import", "--owner", owner, stdin="nsec1" + cli_secret + "\n")).returncode != 0
    assert (await run.cli("agent", "list", "--json")).returncode == 0
    issued = await run.cli("credential", "issue", "--agent", agent_c, "--channel", channel,
                          "--all-actions", "--uid", str(os.getuid()))
    assert issued.returncode == 0
    cred_c = issued.stdout.strip()
    scan.add(text_secret("credential C (CLI issued)", cred_c, prefix=TOKEN_PREFIX))
    # The one designated place for that token: re-labelled as allowed there.
    run.outputs = [(w, b, a | {"credential C (CLI issued)"}) if w.startswith("CLI credential issue stdout")
                   else (w, b, a) for w, b, a in run.outputs]
    assert scan.contains(issued.stdout, "credential C (CLI issued)")  # control: the scan sees it
    assert (await run.cli("credential", "list")).returncode == 0
    cred_file = tmp_path / "agent-c.credential"
    cred_file.write_text(cred_c + "\n")
    cred_file.chmod(0o600)
    called = await run.cli("call", "message.post", "--credential-file", str(cred_file),
                     "--socket", str(broker.socket),
                     "--args", json.dumps({"channelId": channel, "content": "from the CLI"}))
    assert called.returncode == 0, called.stderr
    assert json.loads(called.stdout)["status"] == "succeeded"
    typed = await run.cli("call", "typing.set", "--credential-file", str(cred_file),
                          "--socket", str(broker.socket), "--args", json.dumps({"channelId": channel}))
    assert typed.returncode == 0, typed.stderr
    assert json.loads(typed.stdout)["outcome"]["kind"] == 20002
    remembered = await run.cli("call", "storage.get", "--credential-file", str(cred_file),
                               "--socket", str(broker.socket),
                               "--args", json.dumps({"slug": "mem/cli"}),
                               allowed=frozenset({"memory value"}))
    assert remembered.returncode == 0 and json.loads(remembered.stdout)["outcome"] == {}
    refused = await run.cli("call", "channel.read", "--credential-file", str(tmp_path / "missing"),
                      "--socket", str(broker.socket), "--args", json.dumps({"channelId": channel}))
    assert refused.returncode != 0
    assert (await run.cli("check-config")).returncode == 0

    for token in broker.issued:
        scan.add(text_secret(f"credential #{broker.issued.index(token)} (harness)", token,
                             prefix=TOKEN_PREFIX))

    # --- what the relay holds: every event our agents and their owner produced ------------
    events = await trio.to_thread.run_sync(
        nostr_fetch, broker.relay_url, [{"authors": [agent_a, agent_b, agent_c, owner]},
                                        {"#h": [channel]}])
    assert len(events) >= 8
    run.keep("relay events", json.dumps(events))

    # --- the scan ------------------------------------------------------------------------
    leaks: list[str] = []
    for where, blob, allowed in run.outputs:
        leaks += scan.findings(blob, where, allowed=allowed)
    formatter = logging.Formatter("%(levelname)s %(name)s %(message)s")
    for record in caplog.records:
        text = formatter.format(record) + repr(vars(record))
        leaks += scan.findings(text, f"log record {record.name}")
    captured = capfd.readouterr()
    leaks += scan.findings(captured.out, "captured stdout")
    leaks += scan.findings(captured.err, "captured stderr")
    holders = {mac_key_path.resolve(): {"cursor MAC key"},
               audit_key_path.resolve(): {"audit MAC key"},
               cred_file.resolve(): {"credential C (CLI issued)"},
               Path(softhsm_token.pin_file).resolve(): {"token user PIN"},
               Path(softhsm_token.so_pin_file).resolve(): {"token SO PIN"}}
    file_count = 0
    for root in (tmp_path, softhsm_token.directory):
        for path, data in files_under(root):
            file_count += 1
            leaks += scan.findings(data, f"file {path.name}", allowed=holders.get(path.resolve(), ()))
    assert file_count >= 5 and any(p.name == "ledger.db" for p, _ in files_under(tmp_path))

    # Positive controls: each designated holder really holds its secret.
    assert scan.contains(mac_key_path.read_bytes(), "cursor MAC key")
    assert scan.contains(audit_key_path.read_bytes(), "audit MAC key")
    assert scan.contains(Path(softhsm_token.pin_file).read_bytes(), "token user PIN")
    assert scan.contains(cred_file.read_bytes(), "credential C (CLI issued)")
    assert len(caplog.records) >= 20  # the daemon really logged what it did

    tally("secret_scan", {"secrets": len(scan.labels), "places": scan.places,
                          "bytes": scan.bytes_scanned, "files": file_count,
                          "log_records": len(caplog.records), "leaks": len(leaks)})
    assert not leaks, "secrets leaked:\n" + "\n".join(leaks)
