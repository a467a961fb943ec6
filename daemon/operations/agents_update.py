"""agents.update: patch a managed agent the requester owns.

Steps (buzz-on-the-relay.md, "The nine operations"):
1. Resolve the target (by pubkey or by name) among the requester's live agents (policy).
2. Read the current 30177 record from the relay, merge the members given, and compute
   `updatedFields`: the wire names whose value actually changed, sorted. A member given with
   its current value is not an update.
3. Nothing changed → succeed without publishing anything (a new version identical to the
   old would only churn the relay).
4. Publish the merged record (owner-signed, created_at after the previous version; every
   member read and not set kept, `parallelism` included, `runtime` never), and the agent's
   own kind 0 when the name changed; then the keystore's name follows.
5. `runtime` is the host's own record (daemon/state/runtimes.py), compared and written there; an
   update of the runtime alone publishes nothing.

Rule (issue 13, relay data is checked before it is signed over): the owner re-signs what
it merges, so every record the relay answers must be exactly the one asked for — kind
30177, authored by the owner, `d` tag the agent's pubkey. A relay that answers anything
else (another agent's record, another author's, another kind) is lying or broken:
`action_failed`, and nothing is signed.
"""

from __future__ import annotations

import json

import trio

from buzzwire.contract import AgentsUpdateArgs, AgentsUpdateOutcome, ErrorCode, Verdict
from daemon.operations._base import Context, OperationRefused, Plan
from daemon.operations._events import (
    check_builds_on_latest,
    fetch,
    json_object_or_none,
    newest,
    next_created_at,
    sign_all,
    tag_value,
)
from daemon.operations._managed import (
    ARG_ATTRIBUTES,
    KIND_MANAGED_AGENT,
    RECORD_MEMBERS,
    is_record_of,
    outcome_name,
    owned_target,
    record_content,
)
from daemon.operations.profile_set import KIND_METADATA, current_profile
from daemon.pipeline.pending import Cleanup, RenameAgent, SetRuntime

ACTION = "agents.update"


async def prepare(ctx: Context, args: AgentsUpdateArgs) -> Plan | Verdict:
    owner = ctx.principal.agent
    # Its lock is held (the pipeline took it with the requester's): the agent's own
    # profile.set merges into the same kind 0 this may rewrite.
    agent = owned_target(ctx)
    found = await fetch(
        ctx, {"kinds": [KIND_MANAGED_AGENT], "authors": [owner], "#d": [agent.pubkey], "limit": 5}
    )
    for event in found:
        if not is_record_of(event, owner, agent.pubkey):
            raise OperationRefused(
                ErrorCode.ACTION_FAILED,
                "the relay answered with a record that is not this agent's",
                detail=f"event {event.id} kind {event.kind} by {event.pubkey}"
                       f" d {str(tag_value(event, 'd'))[:80]!r}",
            )
    previous = newest(found)
    check_builds_on_latest(ctx, owner, KIND_MANAGED_AGENT, agent.pubkey, previous)
    current: dict[str, object] = (
        (json_object_or_none(previous.content) or {}) if previous is not None else {}
    )
    current.setdefault("name", agent.name)

    fields: dict[str, object] = {}
    updated: list[str] = []
    for wire, member in RECORD_MEMBERS.items():
        value = getattr(args, ARG_ATTRIBUTES[wire])
        if value is not None and current.get(member) != value:
            fields[member] = value
            updated.append(wire)
    record_changed = bool(updated)
    runtimes = ctx.runtimes
    if args.runtime is not None:
        assert runtimes is not None, "agents.update needs the host's runtime record"
        if runtimes.get(agent.pubkey) != args.runtime:
            updated.append("runtime")
    name = outcome_name(fields.get("name") or current.get("name") or agent.name, agent.pubkey)
    outcome = AgentsUpdateOutcome(agent_pubkey=agent.pubkey, display_name=name,
                                  updated_fields=tuple(sorted(updated)))
    if not updated:
        return Verdict.succeeded(ACTION, outcome)
    if not record_changed:
        # Only the runtime changed: it is the host's own record (the 30177 carries no runtime
        # fields), so nothing goes to the relay. The upsert is idempotent.
        assert runtimes is not None and args.runtime is not None
        await trio.to_thread.run_sync(runtimes.set, agent.pubkey, args.runtime, ctx.now())
        return Verdict.succeeded(ACTION, outcome)

    now = ctx.now()
    drafts = [
        (owner, KIND_MANAGED_AGENT, [("d", agent.pubkey)], record_content(fields, read=current),
         next_created_at(now, previous)),
    ]
    commit: list[Cleanup] = []
    if "runtime" in updated:
        assert args.runtime is not None
        commit.append(SetRuntime(pubkey=agent.pubkey, runtime=args.runtime))
    if "displayName" in updated:
        profile, profile_event = await current_profile(ctx, agent.pubkey)
        profile["display_name"] = name
        profile["name"] = name
        drafts.append(
            (agent.pubkey, KIND_METADATA, [],
             json.dumps(profile, ensure_ascii=False, separators=(",", ":")),
             next_created_at(now, profile_event))
        )
        commit.append(RenameAgent(pubkey=agent.pubkey, name=name))
    events = await sign_all(ctx, drafts)
    return Plan(events=tuple(events), outcome=outcome, commit=tuple(commit))
