"""Issue 22 L5: a NIP-OA tag with conditions is refused wherever a tag enters.

This host puts the stored tag on every kind it signs and reads no conditions, so a tag
whose owner limited it (conditions not "") would be carried where the owner did not allow
it. `agent import --auth-tag`, `agent attach-auth` and `keys restore` all refuse one with
one clear line (custody/_signer.py `owner_tag_fault`); conditions "" (Buzz's) still pass.
"""

from __future__ import annotations

import json
import sqlite3

import coincurve

from buzzwire.nostr import owner_tag_digest
from tests.backup.test_backup import Host, age_identity
from tests.custody._secrets import PUB_1, PUB_2, SECRET_1, SECRET_2, assert_no_secrets
from tests.fixtures.token import SoftHsmToken
from tests.json_lines import json_lines

CONDITIONS = "kind=1&created_at<1900000000"


def _owner_tag(conditions: str) -> list[str]:
    """PUB_2's validly signed NIP-OA tag for PUB_1 with `conditions`."""
    sig = coincurve.PrivateKey(bytes.fromhex(SECRET_2)).sign_schnorr(
        owner_tag_digest(PUB_1, conditions))
    return ["auth", PUB_2, conditions, sig.hex()]


def _listed_tag(host: Host) -> object:
    return json_lines(host("agent", "list", "--json").stdout)[0]["authTag"]


def test_import_and_attach_refuse_conditions(softhsm_token: SoftHsmToken, tmp_path) -> None:  # type: ignore[no-untyped-def]
    host = Host(softhsm_token, tmp_path / "host")
    conditioned = json.dumps(_owner_tag(CONDITIONS))
    done = host("agent", "import", "--owner", PUB_2, "--auth-tag", conditioned, stdin=SECRET_1)
    assert done.returncode == 1 and done.stdout == ""
    assert "conditions" in done.stderr and len(done.stderr.splitlines()) == 1
    assert json_lines(host("agent", "list", "--json").stdout) == []  # nothing was sealed

    assert host("agent", "import", "--owner", PUB_2, stdin=SECRET_1).returncode == 0
    for how in (["--tag", conditioned], ["--sig", _owner_tag(CONDITIONS)[3], "--conditions",
                                         CONDITIONS]):
        done = host("agent", "attach-auth", "--agent", PUB_1, *how)
        assert done.returncode == 1 and "conditions" in done.stderr, done.stderr
        assert _listed_tag(host) is None  # nothing stored
    assert_no_secrets(host.cli.transcript)


def test_import_keeps_accepting_buzzs_empty_conditions(softhsm_token: SoftHsmToken,
                                                       tmp_path) -> None:  # type: ignore[no-untyped-def]
    host = Host(softhsm_token, tmp_path / "host")
    tag = _owner_tag("")
    done = host("agent", "import", "--owner", PUB_2, "--auth-tag", json.dumps(tag), stdin=SECRET_1)
    assert done.returncode == 0, done.stderr
    assert _listed_tag(host) == tag


def test_restore_refuses_a_backed_up_tag_with_conditions(softhsm_token: SoftHsmToken,
                                                         tmp_path) -> None:  # type: ignore[no-untyped-def]
    source = Host(softhsm_token, tmp_path / "source")
    assert source("agent", "import", "--owner", PUB_2, stdin=SECRET_1).returncode == 0
    # A keystore from before the rule (or a crafted backup) holds a conditioned tag.
    db = sqlite3.connect(source.cli.state / "keystore.db")
    with db:
        db.execute("UPDATE keys SET auth_tag = ? WHERE pubkey = ?",
                   (json.dumps(_owner_tag(CONDITIONS)), PUB_1))
    db.close()
    identity, out = tmp_path / "identity.txt", tmp_path / "agents.age"
    backed = source("keys", "backup", "--recipient", age_identity(identity), "--out", str(out))
    assert backed.returncode == 0, backed.stderr

    target = Host(softhsm_token, tmp_path / "target")
    done = target("keys", "restore", "--identity", str(identity), str(out), "--yes")
    assert done.returncode == 1 and "conditions" in done.stderr, done.stderr
    assert json_lines(target("agent", "list", "--json").stdout) == []
