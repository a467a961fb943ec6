"""The operations, one module each, and the table the pipeline dispatches on.

A read (`channel.read`, `storage.address`, `storage.get`) exports `execute(ctx, args) -> Verdict`; a
publishing operation exports `prepare(ctx, args) -> Plan | Verdict` and the pipeline
records, publishes and finishes the plan. `OPERATIONS` is checked at import against the
contract's `ActionSpec` table: the same names, and `prepare` exactly for the
publishing ones.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from buzzwire.contract import ACTIONS, Verdict
from daemon.operations import (
    agents_create,
    agents_delete,
    agents_update,
    channel_read,
    liveness_ping,
    message_post,
    message_reply,
    observer_emit,
    presence_set,
    profile_set,
    reaction_add,
    storage_address,
    storage_get,
    storage_put,
    typing_set,
)
from daemon.operations._base import Context, Plan

__all__ = ["OPERATIONS", "Operation", "Context", "Plan"]


@dataclass(frozen=True, slots=True)
class Operation:
    """How the pipeline runs one action: `execute` answers directly, `prepare` plans a publish.

    `serialize_per_agent` marks read-merge-write operations: two of them for one agent at
    once would each read the same old state and one update would be lost (design.md traps).
    """

    # Each takes (Context, its own argument type): the contract's ActionSpec fixes which,
    # per action, and the pipeline passes the `args` the contract built for that action.
    execute: Callable[..., Awaitable[Verdict]] | None = None
    prepare: Callable[..., Awaitable[Plan | Verdict]] | None = None
    serialize_per_agent: bool = False


OPERATIONS: dict[str, Operation] = {
    "channel.read": Operation(execute=channel_read.execute),
    "storage.address": Operation(execute=storage_address.execute),
    "storage.get": Operation(execute=storage_get.execute),
    "storage.put": Operation(prepare=storage_put.prepare, serialize_per_agent=True),
    "message.post": Operation(prepare=message_post.prepare),
    "message.reply": Operation(prepare=message_reply.prepare),
    "reaction.add": Operation(prepare=reaction_add.prepare),
    "profile.set": Operation(prepare=profile_set.prepare, serialize_per_agent=True),
    "agents.create": Operation(prepare=agents_create.prepare, serialize_per_agent=True),
    "agents.update": Operation(prepare=agents_update.prepare, serialize_per_agent=True),
    "agents.delete": Operation(prepare=agents_delete.prepare, serialize_per_agent=True),
    "presence.set": Operation(prepare=presence_set.prepare),
    "typing.set": Operation(prepare=typing_set.prepare),
    # Both answer with a Verdict from `prepare`: observer.emit's effect is intake into the
    # observer queue, released once the verdict is recorded (daemon/pipeline/observer.py);
    # liveness.ping is refused as unsupported (its module says why).
    "observer.emit": Operation(prepare=observer_emit.prepare),
    "liveness.ping": Operation(prepare=liveness_ping.prepare),
}


def _check_against_contract() -> None:
    if OPERATIONS.keys() != ACTIONS.keys():
        raise AssertionError("OPERATIONS and the contract's ACTIONS name different actions")
    for name, op in OPERATIONS.items():
        if (op.execute is None) == (op.prepare is None):
            raise AssertionError(f"{name}: exactly one of execute, prepare")
        if (op.prepare is not None) != ACTIONS[name].publishing:
            raise AssertionError(f"{name}: prepare must match ActionSpec.publishing")


_check_against_contract()
