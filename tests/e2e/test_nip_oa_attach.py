"""NIP-OA for an agent whose owner is a person (issue 15 item 3), against LocalRelay.

The operator runs `agent create --owner` and is told exactly what the owner signs; the
owner signs it elsewhere; `agent attach-auth` verifies and stores the tag and republishes
the agent's kind 0 with it. From then on every event the agent signs carries exactly that
one tag. A forged tag is refused and nothing is stored; `agent list` and `serve` name the
agents still without a tag.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import uuid
from pathlib import Path

import coincurve
import pytest
import trio

from buzzwire.nostr import owner_tag_digest, verify_owner_tag
from custody import Custody, TokenConfig
from daemon.wiring import running
from daemon.config import load_config
from tests.fixtures.broker import BrokerHarness, write_config
from tests.fixtures.relay import nostr_fetch, nostr_verify
from tests.fixtures.token import REPO
from tests.json_lines import json_lines

BUZZ_BROKER = REPO / ".venv" / "bin" / "buzz-broker"


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(BUZZ_BROKER), "--config", str(config), *args], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ))
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _sign(key: coincurve.PrivateKey, agent: str, conditions: str = "") -> str:
    return key.sign_schnorr(owner_tag_digest(agent, conditions), os.urandom(32)).hex()


def _xonly(key: coincurve.PrivateKey) -> str:
    return key.public_key_xonly.format().hex()


async def test_a_tag_attached_after_create_is_on_every_later_event(broker: BrokerHarness) -> None:
    run = trio.to_thread.run_sync
    person, forger = coincurve.PrivateKey(), coincurve.PrivateKey()
    owner = _xonly(person)

    made = await run(lambda: _cli(broker.config_path, "agent", "create", "--owner", owner,
                                  "--name", "Helper"))
    assert made.returncode == 0, made.stderr
    agent = made.stdout.strip()
    digest = owner_tag_digest(agent, "").hex()
    # Exactly what the owner must sign: pubkey, conditions, preimage and its sha256.
    for fact in (agent, '""', f"nostr:agent-auth:{agent}:", digest, "attach-auth"):
        assert fact in made.stderr, (fact, made.stderr)

    listed = json_lines((await run(lambda: _cli(broker.config_path, "agent", "list", "--json"))).stdout)
    assert [a["authTagMissing"] for a in listed if a["pubkey"] == agent] == [True]
    table = (await run(lambda: _cli(broker.config_path, "agent", "list"))).stdout
    assert any(agent in line and "NO-AUTH-TAG" in line for line in table.splitlines())

    # Forged: signed by another key, or naming another owner, or over other conditions.
    forged_sig = _sign(forger, agent)
    for attempt in (
        ("--sig", forged_sig),
        ("--tag", json.dumps(["auth", _xonly(forger), "", forged_sig])),
        ("--sig", _sign(person, agent, "kind=1"), "--conditions", ""),
    ):
        refused = await run(lambda a=attempt: _cli(broker.config_path, "agent", "attach-auth",
                                                   "--agent", agent, *a))
        assert refused.returncode != 0 and refused.stderr.strip(), refused
    assert broker.custody.agent(agent).auth_tag is None

    sig = _sign(person, agent)
    attached = await run(lambda: _cli(broker.config_path, "agent", "attach-auth", "--agent", agent,
                                      "--sig", sig))
    assert attached.returncode == 0, attached.stderr
    tag = ["auth", owner, "", sig]
    assert list(broker.custody.agent(agent).auth_tag or ()) == tag and verify_owner_tag(tag, agent)

    profiles = await run(nostr_fetch, broker.relay_url, [{"kinds": [0], "authors": [agent]}])
    newest = max(profiles, key=lambda e: e["created_at"])
    assert nostr_verify(newest)
    assert [t for t in newest["tags"] if t[0] == "auth"] == [tag]
    assert json.loads(newest["content"])["name"] == "Helper"

    # The agent's next event, through the daemon that was running all along.
    channel = str(uuid.uuid4())
    cred = broker.credential(agent, [channel])
    post = await broker.call(cred, "message.post", {"channelId": channel, "content": "owned"})
    [event] = await run(nostr_fetch, broker.relay_url, [{"ids": [post["outcome"]["eventId"]]}])
    assert nostr_verify(event) and [t for t in event["tags"] if t[0] == "auth"] == [tag]

    listed = json_lines((await run(lambda: _cli(broker.config_path, "agent", "list", "--json"))).stdout)
    assert [a["authTagMissing"] for a in listed if a["pubkey"] == agent] == [False]


async def test_serve_warns_at_start_for_each_agent_without_a_tag(
    custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    token, state_dir = custody_state
    owner = _xonly(coincurve.PrivateKey())
    async with await Custody.open(token, state_dir) as custody:
        bare = await custody.mint_agent(owner=owner,
                                        mint_ref=None)
        tagged = await custody.mint_agent(owner=bare.pubkey, mint_ref=None)
    assert tagged.auth_tag is not None  # its owner is held here: custody made the tag
    config = load_config(str(write_config(tmp_path / "b.toml", token=token, state_dir=state_dir,
                                          socket=tmp_path / "b.sock", relay_url=local_relay)))
    caplog.set_level(logging.WARNING, logger="buzz_broker")
    async with running(config):
        pass
    warned = [getattr(r, "buzz_fields", {}) for r in caplog.records
              if r.getMessage() == "agent.auth_tag_missing"]
    assert [w.get("agent") for w in warned] == [bare.pubkey]
