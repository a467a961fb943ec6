"""docs/protocol.md §7's worked vector: NIP-01's serialization, the id, the BIP-340 signature.

The vector is read from the doc. Its serialization is recomputed by this repository's
`buzzwire.nostr` and by node's `JSON.stringify` (the rule the doc gives both follow); the
event is verified by `buzzwire.nostr.verify_event`, by nostr-sdk (rust-nostr: an
implementation that shares no code with ours), by coincurve called as the doc's table
says, and by @noble/curves installed from docs/examples/node's lockfile. Every one-byte
tampering of the event is refused by all of them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import coincurve
import nostr_sdk
import pytest

from buzzwire.nostr import compute_event_id, serialize_event, verify_event
from tests.docs.node_deps import MIN_NODE, node_modules, node_version
from tests.docs.snippets import REPO, block

PROTOCOL_MD = REPO / "docs" / "protocol.md"


def _vector() -> dict[str, Any]:
    event = json.loads(block(PROTOCOL_MD, "nip01-vector-event"))
    assert isinstance(event, dict)
    return event


def _tampered(event: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    copy: dict[str, Any] = json.loads(json.dumps(event))
    change(copy)
    return copy


def _rehash(e: dict[str, Any]) -> None:
    """Make the id match a changed content again, so only the signature can catch it."""
    e["content"] = e["content"].replace("quote", "quotE")
    e["id"] = compute_event_id(e["pubkey"], e["created_at"], e["kind"], e["tags"], e["content"])


def _flip_last_hex(value: str) -> str:
    return value[:-1] + ("0" if value[-1] != "0" else "1")


#: Each changes one thing; every verifier must refuse every one.
TAMPERINGS: dict[str, Callable[[dict[str, Any]], None]] = {
    "content": lambda e: e.update(content=e["content"].replace("é", "e")),
    "tag": lambda e: e["tags"][1].__setitem__(3, "root"),
    "created_at": lambda e: e.update(created_at=e["created_at"] + 1),
    "kind": lambda e: e.update(kind=1),
    "id re-hashed, signature kept": _rehash,
    "signature": lambda e: e.update(sig=_flip_last_hex(e["sig"])),
    "pubkey": lambda e: e.update(pubkey=_flip_last_hex(e["pubkey"])),
    # JSON can spell a lone surrogate; it has no UTF-8 form, so no NIP-01 id: refused, and
    # never an exception out of a verifier that "never raises for bad input".
    "lone surrogate": lambda e: e.update(content=e["content"] + "\ud800"),
}


def _nostr_sdk_accepts(event: dict[str, Any]) -> bool:
    try:
        return bool(nostr_sdk.Event.from_json(json.dumps(event, ensure_ascii=False)).verify())
    except Exception:  # nostr-sdk raises its own error types for a malformed event
        return False


def _coincurve_accepts(event: dict[str, Any]) -> bool:
    # The doc's table, as written; the id is checked first (step 2).
    try:
        body = serialize_event(event["pubkey"], event["created_at"], event["kind"],
                               event["tags"], event["content"])
    except UnicodeEncodeError:
        return False
    if hashlib.sha256(body).hexdigest() != event["id"]:
        return False
    try:
        return bool(coincurve.PublicKeyXOnly(bytes.fromhex(event["pubkey"])).verify(
            bytes.fromhex(event["sig"]), bytes.fromhex(event["id"])))
    except ValueError:
        return False


def test_the_serialization_and_id_are_nip01s() -> None:
    event = _vector()
    written = block(PROTOCOL_MD, "nip01-vector-serialization").rstrip("\n").encode("utf-8")
    assert serialize_event(event["pubkey"], event["created_at"], event["kind"], event["tags"],
                           event["content"]) == written
    assert len(written) == 308, "the doc states the byte count"
    assert hashlib.sha256(written).hexdigest() == event["id"]
    # Every escape the doc lists, and what it says is kept verbatim, are in the vector.
    for escaped in (r"\n", r"\"", r"\\", r"\r", r"\t", r"\b", r"\f", r"\u0001"):
        assert escaped.encode() in written, escaped
    for verbatim in ("é", "👀", "/", "<b>&"):
        assert verbatim.encode("utf-8") in written, verbatim


def test_the_vector_verifies_with_buzzwire_nostr_sdk_and_coincurve() -> None:
    event = _vector()
    assert verify_event(event)
    assert _nostr_sdk_accepts(event)
    assert _coincurve_accepts(event)


@pytest.mark.parametrize("name", sorted(TAMPERINGS))
def test_every_tampering_is_refused_by_every_python_verifier(name: str) -> None:
    bad = _tampered(_vector(), TAMPERINGS[name])
    assert (verify_event(bad), _nostr_sdk_accepts(bad), _coincurve_accepts(bad)) == (
        False, False, False)


#: What the doc's table says for Node: node:crypto's sha256 of JSON.stringify, and
#: @noble/curves' schnorr.verify over the id.
_NODE_CHECK = """
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { schnorr } from "@noble/curves/secp256k1.js";
import { hexToBytes } from "@noble/curves/utils.js";

const { events } = JSON.parse(readFileSync(process.argv[2], "utf8"));
const results = events.map((e) => {
  const serialized = JSON.stringify([0, e.pubkey, e.created_at, e.kind, e.tags, e.content]);
  const id = createHash("sha256").update(serialized, "utf8").digest("hex");
  let sig = false;
  try { sig = schnorr.verify(hexToBytes(e.sig), hexToBytes(e.id), hexToBytes(e.pubkey)); } catch { sig = false; }
  return { serialized, accepted: id === e.id && sig };
});
console.log(JSON.stringify(results));
"""


def test_node_with_noble_curves_agrees(tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node is not None, "node is missing: `make deps` installs nodejs"
    assert node_version(node) >= MIN_NODE, (
        f"node {node_version(node)} is older than @noble/curves 2.4.0 needs (>= 20.19)")
    (tmp_path / "node_modules").symlink_to(node_modules(), target_is_directory=True)
    script = tmp_path / "check.mjs"
    script.write_text(_NODE_CHECK)
    good = _vector()
    events = [good] + [_tampered(good, TAMPERINGS[n]) for n in sorted(TAMPERINGS)]
    # ASCII escapes: the file must hold the lone surrogate too (node reads the same strings).
    (tmp_path / "events.json").write_text(json.dumps({"events": events}))
    ran = subprocess.run([node, str(script), str(tmp_path / "events.json")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    results = json.loads(ran.stdout)
    written = block(PROTOCOL_MD, "nip01-vector-serialization").rstrip("\n")
    assert results[0] == {"serialized": written, "accepted": True}
    assert [r["accepted"] for r in results[1:]] == [False] * len(TAMPERINGS)
