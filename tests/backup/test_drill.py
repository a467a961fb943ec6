"""The drill (issue 18 item 6): what an operator does after losing a host.

Back up, destroy the state directory and the token (its whole directory, PINs included),
make a new token, restore, and the agents post through the real daemon (a process of its
own, `tests.adversarial.crashing_daemon` with no crash step) to a real LocalRelay with
NIP-42 AUTH, under the same pubkeys, the owned agent still carrying the same NIP-OA tag, and
`storage.address` answers the same d-tags. Credentials are not in a backup: the old one is
refused on the new host, a new one is issued. The ledger is not either: the request sent
before the loss, sent again byte for byte, runs again as a new event (docs/install.md,
"Restore").

Every step goes through the `buzz-broker` command line and the daemon, each in its own
process: the tokens here are not the session's, and SoftHSM reads SOFTHSM2_CONF once per
process. The tokens are started by tests/tokens/kinds.py (`start`), as the four-token run
starts them. The lost host's token is SoftHSM; the new host's is the kind of the run
(BUZZ_TEST_TOKEN_KIND: SoftHSM in the main suite, then the TPM and p11-kit in the
four-token run, i.e. a move to another kind of token by backup and restore). opencryptoki
is skipped: a second one cannot start inside the namespace the run's own occupies.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from custody import TokenConfig
from tests.adversarial._daemon import DaemonProcess, envelope, post, request_body
from tests.backup.test_backup import age_identity
from tests.custody._secrets import assert_no_secrets
from tests.fixtures.broker import write_config
from tests.fixtures.relay import TestKey, nostr_fetch, nostr_verify
from tests.fixtures.token import REPO
from tests.tokens import kinds
from tests.json_lines import json_lines

BUZZ_BROKER = REPO / ".venv" / "bin" / "buzz-broker"
KEK_LABEL = "buzz-broker-kek"
SLUGS = ("core", "mem/drill")


@dataclass
class Host:
    """One host: a token (from kinds.start), a state dir, a config, the CLI and daemon env."""

    facts: Mapping[str, str]
    directory: Path
    relay_url: str
    transcript: bytes = b""

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("SOFTHSM2_CONF", "BUZZ_BROKER_CONFIG")}
        return env | dict(self.facts)

    @property
    def state(self) -> Path:
        return self.directory / "state"

    @property
    def socket(self) -> Path:
        return self.directory / "b.sock"

    @property
    def config(self) -> Path:
        token = TokenConfig(module=self.facts[kinds.ENV_MODULE], token_label=self.facts[kinds.ENV_LABEL],
                            pin_file=self.facts[kinds.ENV_PIN_FILE], kek_label=KEK_LABEL)
        path = self.directory / "broker.toml"
        if not path.exists():
            write_config(path, token=token, state_dir=self.state, socket=self.socket,
                         relay_url=self.relay_url)
        return path

    def __call__(self, *args: str, stdin: str = "") -> str:
        done = subprocess.run([str(BUZZ_BROKER), "--config", str(self.config), *args],
                              input=stdin, capture_output=True, text=True, timeout=120,
                              env=self.env, check=False)
        self.transcript += (done.stdout + done.stderr).encode()
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)
        return done.stdout

    def make_kek(self) -> None:
        if not kinds.KINDS[self.facts[kinds.ENV_KIND]].offers["GENERATE_KEY"]:
            kinds.add_tpm_keys(KEK_LABEL, env=self.env)  # the operator's step on a TPM
        self("keys", "init")

    def credential(self, agent: str, channel: str) -> str:
        return self("credential", "issue", "--agent", agent, "--channel", channel,
                    "--all-actions", "--ttl", "1d", "--uid", str(os.getuid())).strip()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="bb-drill-") as name:
        yield Path(name)


async def _call(host: Host, credential: str, action: str, args: Mapping[str, Any],
                request_id: str | None = None) -> dict[str, Any]:
    return envelope(await post(host.socket, request_body(action, args, request_id=request_id),
                               credential))


async def _serve_and_use(host: Host, agents: Mapping[str, str], channel: str,
                         credentials: Mapping[str, str]) -> dict[str, Any]:
    """Start the daemon, post once as each agent and ask each for its d-tags; stop it."""
    daemon = await DaemonProcess.start(host.config, host.socket, env=host.env)
    seen: dict[str, Any] = {"posts": {}, "d_tags": {}}
    try:
        for name, agent in agents.items():
            posted = await _call(host, credentials[name], "message.post",
                                 {"channelId": channel, "content": f"{name} after {host.directory.name}"})
            assert posted["status"] == "succeeded", posted
            seen["posts"][name] = posted["outcome"]["eventId"]
            seen["d_tags"][name] = []
            for slug in SLUGS:
                address = await _call(host, credentials[name], "storage.address", {"slug": slug})
                assert address["status"] == "succeeded", address
                assert address["outcome"]["authorPubkey"] == agent
                seen["d_tags"][name].append(address["outcome"]["dTag"])
    finally:
        assert await daemon.stop() == 0
    seen["log"] = daemon.log().encode()
    return seen


async def test_lose_the_host_restore_from_backup_and_carry_on(
    local_relay: str, short_dir: Path
) -> None:
    new_kind = os.environ.get(kinds.ENV_KIND) or "softhsm"
    if new_kind in kinds.NEEDS_NAMESPACE:
        pytest.skip(f"a second {new_kind} token cannot start inside this run's namespace")
    channel = str(uuid.uuid4())
    human, boss_key = TestKey(), TestKey()
    with kinds.start("softhsm") as facts:
        old_token_dir = Path(facts[kinds.ENV_DIR])
        old = Host(facts, short_dir / "old", local_relay)
        old.directory.mkdir()
        old.make_kek()
        boss = old("agent", "import", "--owner", human.pubkey, "--name", "boss",
                   stdin=boss_key.secret_hex).strip()
        helper = old("agent", "create", "--owner", boss, "--name", "helper").strip()
        agents = {"boss": boss, "helper": helper}
        before_records = {r["pubkey"]: r for r in json_lines(old("agent", "list", "--json"))}
        old_credentials = {name: old.credential(agent, channel) for name, agent in agents.items()}
        before = await _serve_and_use(old, agents, channel, old_credentials)
        # The request the boss sent before the loss, kept byte for byte by its client.
        first_post = request_body("message.post", {"channelId": channel, "content": "once"},
                                  request_id="drill-request-1")
        daemon = await DaemonProcess.start(old.config, old.socket, env=old.env)
        try:
            answered = envelope(await post(old.socket, first_post, old_credentials["boss"]))
        finally:
            await daemon.stop()
        assert answered["status"] == "succeeded"

        identity = short_dir / "identity.txt"
        backup = short_dir / "agents.age"
        old("keys", "backup", "--recipient", age_identity(identity), "--out", str(backup))
    # The host is lost: its token (and PINs) went with kinds.start; now its state too.
    assert not old_token_dir.exists()
    subprocess.run(["rm", "-rf", str(old.directory)], check=True)

    with kinds.start(new_kind) as facts:
        new = Host(facts, short_dir / "new", local_relay)
        new.directory.mkdir()
        new.make_kek()
        restored = new("keys", "restore", "--identity", str(identity), str(backup), "--yes")
        assert restored.count("  restore  ") == 2
        after_records = {r["pubkey"]: r for r in json_lines(new("agent", "list", "--json"))}
        assert after_records == before_records  # pubkeys, owners, NIP-OA tag, depth, names

        # Credentials are not in a backup: the old one means nothing here.
        daemon = await DaemonProcess.start(new.config, new.socket, env=new.env)
        try:
            refused = await _call(new, old_credentials["boss"], "message.post",
                                  {"channelId": channel, "content": "old credential"})
            # The ledger is not in a backup either: the same request runs again.
            new_credentials = {name: new.credential(agent, channel) for name, agent in agents.items()}
            again = envelope(await post(new.socket, first_post, new_credentials["boss"]))
        finally:
            await daemon.stop()
        assert (refused["status"], refused["error"]["code"]) == ("failed", "unauthenticated")
        assert again["status"] == "succeeded" and not again.get("replayed")
        assert again["outcome"]["eventId"] != answered["outcome"]["eventId"]

        after = await _serve_and_use(new, agents, channel, new_credentials)
    assert after["d_tags"] == before["d_tags"]

    events = await trio.to_thread.run_sync(nostr_fetch, local_relay, [{"kinds": [9], "#h": [channel]}])
    by_id = {e["id"]: e for e in events}
    for when in (before, after):
        for name, event_id in when["posts"].items():
            event = by_id[event_id]
            assert nostr_verify(event) and event["pubkey"] == agents[name]
    helper_tags = [[t for t in by_id[w["posts"]["helper"]]["tags"] if t[0] == "auth"]
                   for w in (before, after)]
    assert helper_tags[0] == helper_tags[1] == [before_records[helper]["authTag"]]
    # Nothing the drill printed, logged or left on the new host names a secret.
    scanned = old.transcript + new.transcript + before["log"] + after["log"] + b"".join(
        p.read_bytes() for p in new.state.iterdir() if p.is_file())
    assert b"AGE-SECRET-KEY" not in scanned
    assert_no_secrets(scanned, (boss_key.secret_hex,))
