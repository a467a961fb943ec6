"""The pending record's versioned encoding: what this version writes, and every version it
wrote before, read back to the same typed events and cleanup steps (issue 16).

`vectors/pending_v1.json` is a record exactly as the version before typed cleanup steps
wrote it (`Pending.encode` with format 1, agents.update renaming and setting a runtime,
plus a rollback): a ledger on disk may hold one when the daemon is upgraded mid-request.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from buzzwire.nostr import SignedEvent, verify_signed
from daemon.pipeline.pending import (
    PENDING_FORMAT,
    STEPS,
    Cleanup,
    DestroyAgent,
    Pending,
    RenameAgent,
    SetRuntime,
)

V1 = (Path(__file__).parent / "vectors" / "pending_v1.json").read_bytes()
A, C = "ab" * 32, "cd" * 32


def test_a_version_1_record_is_read() -> None:
    pending = Pending.decode(V1)
    assert pending.action == "agents.update" and pending.success == b'{"ok":1}'
    assert [e.kind for e in pending.events] == [30177, 0]
    # The signed events come back as the one event type, byte-for-byte the same events.
    assert all(isinstance(e, SignedEvent) and verify_signed(e) for e in pending.events)
    assert [e.to_json_obj() for e in pending.events] == json.loads(V1)["events"]
    assert pending.rollback == (DestroyAgent(pubkey=C),)
    # Version 1 ran rename before set_runtime whatever the object's order was.
    assert pending.commit == (RenameAgent(pubkey=A, name="ré"), SetRuntime(pubkey=A, runtime="goose"))


def test_what_this_version_writes_is_read_back() -> None:
    old = Pending.decode(V1)
    again = Pending.decode(old.encode())
    assert again == old
    assert json.loads(old.encode())["v"] == PENDING_FORMAT == 2


def _example(kind: type[Cleanup]) -> Cleanup:
    return kind(**{f.name: f"{f.name}-value" for f in dataclasses.fields(kind)})


@pytest.mark.parametrize("name", list(STEPS))
def test_every_step_round_trips_in_order(name: str) -> None:
    step = _example(STEPS[name])
    pending = dataclasses.replace(Pending.decode(V1), rollback=(step,), commit=(step, step))
    record = json.loads(pending.encode())
    assert record["rollback"] == [{"step": name, **dataclasses.asdict(step)}]
    assert Pending.decode(pending.encode()) == pending


@pytest.mark.parametrize("change", [
    {"v": 3},
    {"v": True},
    {"v": None},
    {"rollback": [{"step": "format_disk", "pubkey": A}]},
    {"rollback": [{"step": "destroy_agent"}]},
    {"rollback": [{"step": "destroy_agent", "pubkey": A, "extra": "x"}]},
    {"commit": [{"step": "set_runtime", "pubkey": A, "runtime": 7}]},
    {"commit": {"destroy_agent": A}},
    {"events": [{"id": "x"}]},
    {"success": 5},
    # Version 2 always writes both arrays: one null (as a missing one reads) is not empty.
    {"rollback": None},
    {"commit": None},
    # A step is an object; a list of pairs only looks like one to dict().
    {"rollback": [[["step", "destroy_agent"], ["pubkey", A]]]},
])
def test_a_record_that_is_not_what_its_version_says_is_refused(change: dict[str, object]) -> None:
    record = json.loads(Pending.decode(V1).encode())
    record.update(change)
    with pytest.raises(ValueError):
        Pending.decode(json.dumps(record).encode())


@pytest.mark.parametrize("steps", [{"destroy_agent": A, "launch": {}}, ["destroy_agent"], {"rename_agent": "x"}])
def test_a_bad_version_1_record_is_refused(steps: object) -> None:
    record = json.loads(V1)
    record["commit"] = steps
    with pytest.raises(ValueError):
        Pending.decode(json.dumps(record).encode())


def test_a_version_1_layout_under_v_true_is_refused() -> None:
    # JSON `true` is not the version 1 (Python's True == 1 would read it as one): here the
    # layout is version 1's, so only the version check itself can refuse it.
    record = json.loads(V1)
    Pending.decode(json.dumps(record).encode())  # the layout itself is read
    record["v"] = True
    with pytest.raises(ValueError):
        Pending.decode(json.dumps(record).encode())
