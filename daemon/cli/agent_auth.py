"""NIP-OA for agents whose owner is a person: what the owner signs, and attaching the tag.

The host cannot make the tag of an agent whose owner's key it does not hold
(buzz-on-the-relay.md "Ownership tag"): the owner signs, with BIP-340, the sha256 of
`"nostr:agent-auth:" + agent_pubkey_hex + ":" + conditions` (Buzz uses conditions "").

Rules:
- `request_text` is what `agent create --owner` prints on stderr when the new agent has no
  tag: the agent pubkey, the conditions, the preimage and its sha256, and the command that
  attaches the signed tag. stdout stays the pubkey alone (scripts read it).
- `agent attach-auth --agent PUBKEY (--tag JSON | --sig HEX [--conditions C])` verifies the
  tag in custody (owner = the agent's recorded owner, the signature over the agent's pubkey
  and conditions) before storing it; a tag that does not verify is refused and nothing is
  stored. With `[custody] custodian_socket` set, custody is the custodian: the tag goes to
  its `attach_auth` row (checked there, under its uid) and the profile to its `sign` row,
  so the command runs as the pipeline's uid with no PIN or token; else custody is opened
  in this process. It then republishes the agent's kind 0 (its newest content, or its name) signed
  with the tag, strictly later than the version it replaces, so Buzz readers see the
  ownership at once; every later event the agent signs carries exactly that one tag.
- Attaching is idempotent: the same command again stores the same tag and republishes, so a
  relay fault after the tag was stored is mended by running it again (the CLI says so).
- The tag is public; nothing secret is read, printed or logged here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from buzzwire import kinds
from buzzwire.nostr import is_hex64
from daemon.cli._common import CliError, UsageError, agent_directory, open_keys

if TYPE_CHECKING:
    from custody import Custody, KeyRecord
    from daemon.config import Config
    from daemon.relay.pool import RelayPool

#: Buzz's conditions: none.
DEFAULT_CONDITIONS = ""
#: buzz-on-the-relay.md: NIP-01 user metadata.
KIND_METADATA = kinds.METADATA


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("attach-auth",
                       help="attach an owner-signed NIP-OA tag to an agent and republish its profile")
    p.add_argument("--agent", required=True, metavar="PUBKEY", help="the agent's pubkey (64 hex)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--tag", metavar="JSON",
                     help='the whole tag, e.g. \'["auth","<owner>","","<sig>"]\'')
    how.add_argument("--sig", metavar="HEX", help="the owner's BIP-340 signature (128 hex)")
    p.add_argument("--conditions", default=DEFAULT_CONDITIONS,
                   help='the conditions the owner signed with --sig (default "", as Buzz)')


def request_text(agent: str, owner: str, conditions: str = DEFAULT_CONDITIONS) -> str:
    """What the owner must sign for `agent`, and how to attach it, for the operator."""
    from buzzwire.nostr import owner_tag_digest

    preimage = f"nostr:agent-auth:{agent}:{conditions}"
    return (
        f"agent {agent} has no NIP-OA tag: its owner {owner} is not held on this host.\n"
        "Its events carry no ownership proof until the owner signs one. The owner signs, "
        "with BIP-340 (Schnorr, the owner's key), the sha256 below:\n"
        f"  agent pubkey: {agent}\n"
        f"  conditions:   {json.dumps(conditions)}\n"
        f"  preimage:     {preimage}\n"
        f"  sha256:       {owner_tag_digest(agent, conditions).hex()}\n"
        f"then: buzz-broker agent attach-auth --agent {agent} --sig <128-hex signature>"
        + (f" --conditions {json.dumps(conditions)}" if conditions else "")
    )


def parse_tag(text: str, flag: str) -> list[str]:
    """A NIP-OA tag given on the command line as JSON (`flag` names the option). Its
    signature is custody's to verify; this only checks the shape."""
    try:
        tag = json.loads(text)
    except (ValueError, RecursionError):
        raise UsageError(f"{flag} is not JSON") from None
    if not isinstance(tag, list) or not all(isinstance(x, str) for x in tag):
        raise UsageError(f'{flag} must be a JSON array of strings: '
                         '["auth", owner, conditions, sig]')
    return tag


def _tag_from_args(args: argparse.Namespace) -> Callable[[str], list[str]]:
    """The tag the arguments give, as a function of the agent's recorded owner (known once
    custody is open); their shape checked now, before anything is opened. Whether the
    signature verifies is custody's to say."""
    if args.tag is not None:
        tag = parse_tag(args.tag, "--tag")
        return lambda _owner: tag
    sig = args.sig.strip().lower()
    if len(sig) != 128 or not is_hex64(sig[:64]) or not is_hex64(sig[64:]):
        raise UsageError("--sig must be the owner's BIP-340 signature: 128 hex characters")
    return lambda owner: ["auth", owner, args.conditions, sig]


async def _republish_profile(config: Config, custody: Custody, record: KeyRecord, name: str
                             ) -> str:
    """Re-sign the agent's newest kind 0 (custody adds the tag) and publish it; its id.

    Raises:
        CliError: the relay could not be read or did not accept the profile.
    """
    from daemon.wiring import relay_pool

    pool = relay_pool(config, custody)
    fault: str | None = None
    event_id = ""
    # Faults are carried out of the nursery as values, so the operator gets one line and
    # not an exception group.
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        try:
            event_id, fault = await _publish_profile(pool, custody, record, name)
        finally:
            nursery.cancel_scope.cancel()
    if fault is not None:
        raise CliError(f"the tag is stored, but {fault}; run the same command again to "
                       "republish the profile")
    return event_id


async def _publish_profile(pool: RelayPool, custody: Custody, record: KeyRecord, name: str
                           ) -> tuple[str, str | None]:
    """Publish the newest kind 0 re-signed (or, with none on the relay, one carrying the
    directory's `name`); its id, or the fault as one line."""
    from custody import CustodyError, UnsignedEvent
    from daemon.operations._events import json_object_or_none, newest, next_created_at, verified
    from daemon.relay.pool import Accepted, RelayRefused, RelayUnavailable

    try:
        found = await pool.query(record.pubkey, [
            {"kinds": [KIND_METADATA], "authors": [record.pubkey], "limit": 5}])
    except (RelayUnavailable, RelayRefused) as exc:
        return "", f"the relay could not be read ({type(exc).__name__})"
    except CustodyError as exc:  # the AUTH to read with (daemon/wiring.py)
        return "", f"the relay's AUTH could not be signed ({exc})"
    previous = newest([e for e in verified(found)
                       if e.pubkey == record.pubkey and e.kind == KIND_METADATA])
    content = (json_object_or_none(previous.content) if previous else None) or {
        "display_name": name, "name": name}
    try:
        signed = await custody.sign_event(record.pubkey, UnsignedEvent(
            pubkey=record.pubkey, created_at=next_created_at(int(time.time()), previous),
            kind=KIND_METADATA, tags=(),
            content=json.dumps(content, ensure_ascii=False, separators=(",", ":"))))
    except CustodyError as exc:
        return "", f"the profile could not be signed ({exc})"
    try:
        result = await pool.publish(record.pubkey, signed)
    except CustodyError as exc:
        return "", f"the relay's AUTH could not be signed ({exc})"
    if not isinstance(result, Accepted):
        return "", f"the relay did not accept the profile ({type(result).__name__})"
    return signed.id, None


def attach(args: argparse.Namespace, config: Config) -> int:
    from custody import CustodyError

    agent = args.agent.strip().lower()
    if not is_hex64(agent):
        raise UsageError("--agent must be 64 hex characters")
    tag_for = _tag_from_args(args)

    async def main() -> tuple[KeyRecord, str]:
        # With a custodian its `attach_auth` row checks the tag, and the profile is
        # signed through its `sign` row (docs/custodian.md): no PIN, no token here.
        custody = await open_keys(config)
        try:
            with agent_directory(config) as directory:
                listed = directory.agent(agent)
            record = custody.agent(agent)
            if record is None or listed is None:
                raise CliError(f"no live agent {agent} is held here")
            stored = await custody.attach_auth_tag(agent, tag_for(record.owner))
            return stored, await _republish_profile(config, custody, stored, listed.name)
        finally:
            await custody.aclose()

    try:
        record, event_id = trio.run(main)
    except CustodyError as exc:
        raise CliError(str(exc)) from None
    except ValueError as exc:  # the relay URL the pool refuses
        raise CliError(f"relay url: {exc}") from None
    print(f"attached the owner's tag to {record.pubkey}; republished its profile {event_id}",
          file=sys.stderr)
    return 0
