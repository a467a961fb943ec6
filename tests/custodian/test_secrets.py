"""Nothing the custodian writes or answers holds a secret: its stderr, its signed log and
every answer of a session that imported, signed, derived, encrypted, decrypted, refused
and broke the table (tests/adversarial/_secrets.py spells each secret every way); and an
import's JSON frames hold no spelling of its secret, which travels only as the frame's raw
tail (custody/custodian/messages.py, `TAILS`)."""

from __future__ import annotations

from pathlib import Path

import coincurve
import pytest

from custody.custodian import client as pipeline_client
from custody.custodian import messages
from custody.custodian.client import CustodianClient
from tests.adversarial._secrets import SecretScan, key_secret, text_secret
from tests.custodian.test_refusals import ask, human, intent
from tests.fixtures.custodian import CustodianProcess


async def test_no_secret_in_the_custodians_log_answers_or_stderr(
        custodian: CustodianProcess, local_relay: str) -> None:
    scan = SecretScan()
    secret = coincurve.PrivateKey()
    scan.add(key_secret("agent", secret.secret.hex()))
    pin_file = custodian.config.read_text().split('pin_file = "', 1)[1].split('"', 1)[0]
    scan.add(text_secret("pin", Path(pin_file).read_text().strip()))
    owner = coincurve.PrivateKey().public_key_xonly.format().hex()
    client = await CustodianClient.open(custodian.socket)
    agent = (await client.import_agent(bytearray(secret.secret.hex().encode()),
                                       owner=owner)).pubkey
    answers = [
        ask(custodian.socket, "sign", events=[intent(agent, 9, [["h", "c"]], "hello")]),
        ask(custodian.socket, "sign", events=[intent(agent, 1, [], "refused")]),
        ask(custodian.socket, "sign_auth", agent=agent, relay_url=local_relay,
            challenge="c", created_at=1),
        ask(custodian.socket, "memory_address", agent=agent, slug="core"),
        ask(custodian.socket, "encrypt", agent=agent, peer=owner,
            plaintexts=[messages.b64(b"note")]),
        ask(custodian.socket, "import", tail=secret.secret.hex().encode(), secret_bytes=64,
            owner=owner, auth_tag=None),
        ask(custodian.socket, "import", tail=b"zz" + secret.secret.hex()[2:].encode(),
            secret_bytes=64, owner=owner, auth_tag=None),
        ask(custodian.socket, "destroy", pubkey=agent),  # its sealed copy is scanned too
    ]
    await client.aclose()
    stderr = custodian.stop()
    leaks = scan.findings(repr(answers), "answers")
    leaks += scan.findings(stderr, "custodian stderr")
    log_dir = custodian.config.parent / "state" / "custodian"
    for path in log_dir.rglob("*"):
        if path.is_file():
            leaks += scan.findings(path.read_bytes(), str(path.name))
    assert not leaks, leaks


async def test_an_import_sends_its_secret_only_as_the_frames_tail(
        custodian: CustodianProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's import: every JSON frame it sends is scanned for the secret (none),
    the key arrives whole (the custodian derives the same pubkey from the tail), and the
    caller's buffer is zero afterwards."""
    scan = SecretScan()
    secret = coincurve.PrivateKey()
    scan.add(key_secret("agent", secret.secret.hex()))
    frames: list[bytes] = []
    real = pipeline_client.request

    def recording(op: str, **args: object) -> bytes:
        frame = real(op, **args)
        frames.append(frame)
        return frame

    monkeypatch.setattr(pipeline_client, "request", recording)
    client = CustodianClient(custodian.socket)
    text = bytearray(secret.secret.hex().encode())
    record = await client.import_agent(text, owner=human())
    await client.aclose()
    assert record.pubkey == secret.public_key_xonly.format().hex()
    assert text == bytearray(len(text))
    assert any(b'"op":"import"' in frame for frame in frames)
    assert not scan.findings(b"".join(frames), "the import's frames")
