"""The pending record: what the ledger holds between the pending commit and the verdict.

Rules (design.md "Idempotency", step 4):
- A pending record is everything a retry after a crash needs to finish a publishing
  request without preparing anything again: the action, the signed events in publish
  order, the exact `succeeded` response (known before publishing), and the host-local
  cleanup steps to run once the relay has answered (`rollback` when the first event is
  refused, `commit` when every event was accepted).
- Cleanup steps are data, not closures (frozen dataclasses, one per kind of step), because
  they are stored and must mean the same after a restart. Each is safe to run twice.
- The encoding is versioned. `PENDING_FORMAT` is what this version writes; every earlier
  version it has written is still read (`_READERS`), because a record written before an
  upgrade is resumed after it. A version not in the table is never guessed at: ValueError.

Versions:
  1: `rollback` / `commit` are JSON objects keyed by step name (`destroy_agent`: pubkey;
     `rename_agent`: {pubkey, name}; `set_runtime`: {pubkey, runtime}), run in that
     order whatever the object's order.
  2: `rollback` / `commit` are arrays of `{"step": name, ...fields}`, run in array order.

WARNING: `STEPS` names each step type once; its names are stored in ledgers on disk and
must never be renamed. A new step is a new name; a changed meaning is a new version.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

from buzzwire.nostr import SignedEvent

__all__ = [
    "PENDING_FORMAT",
    "Pending",
    "DestroyAgent",
    "RenameAgent",
    "SetRuntime",
    "Cleanup",
    "STEPS",
    "steps_named",
]

#: The version of the layout `Pending.encode` writes.
PENDING_FORMAT: Final = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class DestroyAgent:
    """Destroy the agent's sealed key (its record stays a tombstone); revoke its credentials;
    drop what the daemon keeps of keys that are gone (daemon/state/leftovers.py)."""

    pubkey: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RenameAgent:
    """The directory's name for the agent follows the name just published."""

    pubkey: str
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SetRuntime:
    """The host's own record of the agent's runtime (never published)."""

    pubkey: str
    runtime: str


Cleanup: TypeAlias = DestroyAgent | RenameAgent | SetRuntime

#: stored name -> step type. Version 1's object keys are these names too, in run order.
STEPS: Final[Mapping[str, type[Cleanup]]] = {
    "destroy_agent": DestroyAgent,
    "rename_agent": RenameAgent,
    "set_runtime": SetRuntime,
}
_NAMES: Final = {step: name for name, step in STEPS.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class Pending:
    """One publishing request's durable work (module docstring)."""

    action: str
    events: tuple[SignedEvent, ...]
    #: the encoded `succeeded` response, known before publishing
    success: bytes
    rollback: tuple[Cleanup, ...] = ()
    commit: tuple[Cleanup, ...] = ()

    def encode(self) -> bytes:
        """The record in format `PENDING_FORMAT`."""
        return json.dumps(
            {
                "v": PENDING_FORMAT,
                "action": self.action,
                "events": [e.to_json_obj() for e in self.events],
                "success": self.success.decode("utf-8"),
                "rollback": [_encode_step(s) for s in self.rollback],
                "commit": [_encode_step(s) for s in self.commit],
            },
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> Pending:
        """A record of any version this code has written.

        Raises:
            ValueError: an unknown version, or a record that is not what its version says.
        """
        try:
            obj = json.loads(data)
            version = obj["v"]
            if isinstance(version, bool) or version not in _READERS:
                raise ValueError(f"pending record format {version!r} is not one this reads")
            reader = _READERS[version]
            action, success = obj["action"], obj["success"]
            if not isinstance(action, str) or not isinstance(success, str):
                raise ValueError("action and success must be strings")
            events = tuple(SignedEvent.from_json_obj(e) for e in obj["events"])
            return cls(action=action, events=events, success=success.encode("utf-8"),
                       rollback=reader(obj.get("rollback")), commit=reader(obj.get("commit")))
        except (KeyError, TypeError, AttributeError, UnicodeError):
            raise ValueError("not a pending record this version can read") from None


def _encode_step(step: Cleanup) -> dict[str, str]:
    return {"step": _NAMES[type(step)], **{f.name: getattr(step, f.name)
                                           for f in dataclasses.fields(step)}}


def _step(name: object, fields: Mapping[str, object]) -> Cleanup:
    """The step `name` with exactly its fields, each a string; ValueError otherwise."""
    kind = STEPS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"unknown cleanup step {name!r}")
    names = {f.name for f in dataclasses.fields(kind)}
    if set(fields) != names or not all(isinstance(v, str) for v in fields.values()):
        raise ValueError(f"cleanup step {name!r} needs exactly the string fields {sorted(names)}")
    return kind(**{k: str(v) for k, v in fields.items()})


def _read_v1(steps: object) -> tuple[Cleanup, ...]:
    if steps is None:
        return ()
    if not isinstance(steps, dict):
        raise ValueError("version 1 cleanup is an object")
    out = []
    for name in STEPS:  # version 1 ran them in this order, whatever the object's
        if name not in steps:
            continue
        arg = steps[name]
        # destroy_agent's argument was the bare pubkey; the others were objects.
        out.append(_step(name, {"pubkey": arg} if name == "destroy_agent" else arg))
    unknown = set(steps) - set(STEPS)
    if unknown:
        raise ValueError(f"unknown cleanup steps {sorted(unknown)}")
    return tuple(out)


def _read_v2(steps: object) -> tuple[Cleanup, ...]:
    if not isinstance(steps, list):
        raise ValueError("version 2 cleanup is an array")
    out = []
    for item in steps:
        if not isinstance(item, dict):
            raise ValueError("a version 2 cleanup step is an object")
        fields = dict(item)
        out.append(_step(fields.pop("step", None), fields))
    return tuple(out)


#: version -> how that version's cleanup steps are read (the rest of the layout is shared).
_READERS: Final[Mapping[int, Callable[[object], tuple[Cleanup, ...]]]] = {
    1: _read_v1,
    2: _read_v2,
}


def steps_named(steps: Sequence[Cleanup]) -> list[str]:
    """The stored names of `steps`, for the operator log."""
    return [_NAMES[type(s)] for s in steps]
