"""The audit log: chain, tampering, rotation, restart, fail-closed writes, and no secrets."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from daemon.state.audit import (
    GENESIS,
    UNAVAILABLE_MESSAGE,
    AuditLog,
    AuditRecord,
    AuditUnavailable,
    BodyDigest,
    BodyKind,
    Phase,
    Reanchor,
    RefusalCount,
    audit_files,
    read_records,
    verify,
)
from buzzwire.contract import ErrorCode, Status
from daemon.state.audit_mac import BodyMac
from daemon.state.sessions import SessionStore

AGENT = "ab" * 32
CRED = "cred_0123456789abcdef"
NOON = 1796040000.0
#: Small enough that 1,000 records span several files.
ROTATE = 160 * 1024


def record(i: int, *, phase: Phase = Phase.VERDICT, agent: str = AGENT,
           action: str = "message.post", cred: str = CRED) -> AuditRecord:
    verdicts = [(Status.SUCCEEDED, None), (Status.FAILED, ErrorCode.UNAUTHORIZED),
                (Status.INDETERMINATE, ErrorCode.OUTCOME_UNKNOWN)]
    status, code = verdicts[i % 3] if phase is Phase.VERDICT else (None, None)
    return AuditRecord(
        phase=phase, at=NOON + i, credential_id=cred, agent=agent, action=action,
        request_id=f"req-{i:05d}", body=BodyDigest.mac(hashlib.sha256(b"%d" % i).hexdigest()),
        status=status, code=code,
        events=(hashlib.sha256(b"e%d" % i).hexdigest(),) if status is not Status.FAILED else (),
        replayed=phase is Phase.VERDICT and i % 7 == 0,
    )


async def write_log(directory: Path, count: int, *, rotate: int = ROTATE,
                    concurrency: int = 50) -> AuditLog:
    """`count` records appended by `concurrency` tasks, each task's records in its order."""
    log = AuditLog.open(directory, rotate_bytes=rotate)

    async def worker(first: int) -> None:
        for i in range(first, count, concurrency):
            await log.append(record(i))

    async with trio.open_nursery() as nursery:
        for first in range(concurrency):
            nursery.start_soon(worker, first)
    await log.aclose()
    return log


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 1,000-record log across several files, written once; tests copy it."""
    directory = tmp_path_factory.mktemp("pristine") / "audit"
    trio.run(write_log, directory, 1000)
    return directory


@pytest.fixture
def log_dir(pristine: Path, tmp_path: Path) -> Path:
    target = tmp_path / "audit"
    shutil.copytree(pristine, target)
    return target


def lines_of(directory: Path) -> list[tuple[Path, int]]:
    """(file, 1-based line) of every record, in chain order."""
    out: list[tuple[Path, int]] = []
    for _n, path in audit_files(directory):
        count = path.read_bytes().count(b"\n")
        out.extend((path, i) for i in range(1, count + 1))
    return out


def edit_file(path: Path, change: Callable[[list[bytes]], list[bytes]]) -> None:
    path.write_bytes(b"".join(change(path.read_bytes().splitlines(keepends=True))))


def test_untouched_log_verifies(log_dir: Path) -> None:
    files = audit_files(log_dir)
    assert len(files) >= 3  # the chain crosses at least two rotations
    result = verify(log_dir)
    assert result.ok and result.records == 1000 and not result.torn_tail
    # The head is the hash of the last line; the first prev is the genesis value.
    last = files[-1][1].read_bytes().splitlines()[-1]
    assert result.head == hashlib.sha256(last).hexdigest()
    first = json.loads(files[0][1].read_bytes().splitlines()[0])
    assert first["prev"] == GENESIS and first["seq"] == 1
    # Each file's first record chains to the previous file's last line.
    for (_, before), (_, after) in zip(files, files[1:]):
        tail = before.read_bytes().splitlines()[-1]
        assert json.loads(after.read_bytes().splitlines()[0])["prev"] == \
            hashlib.sha256(tail).hexdigest()
    assert verify(log_dir, expect_head=result.head).ok
    assert stat.S_IMODE(os.stat(log_dir).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for _, p in files)


def positions(directory: Path) -> dict[str, int]:
    """Interesting record indexes (0-based): edges of files and the middle."""
    where = lines_of(directory)
    second = next(i for i, (p, line) in enumerate(where) if line == 1 and i > 0)
    return {"first": 0, "middle": 500, "end_of_file_1": second - 1,
            "start_of_file_2": second, "last_but_one": len(where) - 2}


TAMPERING = ("edit", "edit_and_rehash", "delete", "insert", "swap")


@pytest.mark.parametrize("how", TAMPERING)
@pytest.mark.parametrize("where", ["first", "middle", "end_of_file_1", "start_of_file_2",
                                   "last_but_one"])
def test_tampering_is_caught_at_the_first_bad_record(log_dir: Path, how: str,
                                                     where: str) -> None:
    where_all = lines_of(log_dir)
    k = positions(log_dir)[where]
    path, line = where_all[k]
    expected = (path, line)  # where verify must point

    if how in ("edit", "edit_and_rehash"):
        def change(lines: list[bytes]) -> list[bytes]:
            obj = json.loads(lines[line - 1])
            obj["agent"] = "cd" * 32  # make the record say someone else did it
            if how == "edit_and_rehash":
                body = {k: v for k, v in obj.items() if k != "digest"}
                obj["digest"] = hashlib.sha256(json.dumps(
                    body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
            lines[line - 1] = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode() + b"\n"
            return lines
        edit_file(path, change)
        if how == "edit_and_rehash":
            # A consistent rewrite of one record shows at the next record's prev.
            expected = where_all[k + 1]
    elif how == "delete":
        edit_file(path, lambda lines: lines[: line - 1] + lines[line:])
        nxt_path, nxt_line = where_all[k + 1]
        expected = (nxt_path, nxt_line - 1 if nxt_path == path else nxt_line)
    elif how == "insert":
        # A copy of another record put in front of record k.
        donor = where_all[(k + 10) % len(where_all)]
        copy = donor[0].read_bytes().splitlines(keepends=True)[donor[1] - 1]
        edit_file(path, lambda lines: lines[: line - 1] + [copy] + lines[line - 1:])
    elif how == "swap":
        nxt_path, nxt_line = where_all[k + 1]
        if nxt_path == path:
            edit_file(path, lambda lines: lines[: line - 1] + [lines[line], lines[line - 1]]
                      + lines[line + 1:])
        else:  # swap across the file boundary
            mine = path.read_bytes().splitlines(keepends=True)
            theirs = nxt_path.read_bytes().splitlines(keepends=True)
            mine[-1], theirs[0] = theirs[0], mine[-1]
            path.write_bytes(b"".join(mine))
            nxt_path.write_bytes(b"".join(theirs))

    result = verify(log_dir)
    assert not result.ok
    assert (Path(str(result.file)), result.line) == expected, result
    assert result.records == k + (1 if how == "edit_and_rehash" else 0)


def test_last_record_edit_and_tail_truncation(log_dir: Path) -> None:
    head = verify(log_dir).head
    last = audit_files(log_dir)[-1][1]
    original = last.read_bytes()
    lines = original.splitlines(keepends=True)
    # Editing the very last record breaks its own digest.
    last.write_bytes(b"".join(lines[:-1]) + lines[-1].replace(b"message.post", b"message.postx"))
    bad = verify(log_dir)
    assert not bad.ok and bad.line == len(lines) and bad.records == 999
    # Removing it leaves a valid shorter chain: only a remembered head reveals that.
    last.write_bytes(b"".join(lines[:-1]))
    assert verify(log_dir).ok
    cut = verify(log_dir, expect_head=head)
    assert not cut.ok and cut.records == 999


#: The last line rewritten so that it parses to the same object (its digest still
#: matches) but reads otherwise: only the canonical-form check stands in the way.
RESERIALISED = {
    # json keeps the last of two members: a reader of the bytes sees another action.
    "duplicate_member": lambda line: line.replace(
        b'{"action":', b'{"action":"agents.delete","action":', 1),
    "spaces": lambda line: line.replace(b'","', b'", "'),
    "escaped": lambda line: line.replace(b'"action"', b'"\\u0061ction"', 1),
}


@pytest.mark.parametrize("how", RESERIALISED)
def test_a_last_line_in_another_form_of_the_same_object_is_caught(log_dir: Path,
                                                                  how: str) -> None:
    last = audit_files(log_dir)[-1][1]
    lines = last.read_bytes().splitlines(keepends=True)
    changed = RESERIALISED[how](lines[-1][:-1])
    assert changed != lines[-1][:-1]
    assert json.loads(changed) == json.loads(lines[-1])  # the same object, the same digest
    last.write_bytes(b"".join(lines[:-1]) + changed + b"\n")
    result = verify(log_dir)
    assert not result.ok
    assert (result.file, result.line, result.records) == (str(last), len(lines), 999)


def test_missing_files_are_named(log_dir: Path) -> None:
    files = audit_files(log_dir)
    files[1][1].unlink()
    result = verify(log_dir)
    assert not result.ok and result.reason is not None and "audit-000002.jsonl" in result.reason
    files[0][1].unlink()
    assert "audit-000001.jsonl" in str(verify(log_dir).reason)


def test_single_file_verifies_on_its_own(log_dir: Path) -> None:
    files = audit_files(log_dir)
    one = verify(files[1][1])
    assert one.ok and one.records == files[1][1].read_bytes().count(b"\n")
    edit_file(files[1][1], lambda lines: lines[:3] + lines[4:])
    assert verify(files[1][1]).line == 4


@pytest.mark.parametrize("archived", [False, True])
def test_a_partial_line_in_a_file_before_the_last_is_a_fault(log_dir: Path,
                                                             archived: bool) -> None:
    files = audit_files(log_dir)
    if archived:
        archive = log_dir.parent / "archive"
        archive.mkdir()
        files[0][1].rename(archive / files[0][1].name)
        files = files[1:]
    assert len(files) >= 2
    middle = files[0][1]
    count = middle.read_bytes().count(b"\n")
    with open(middle, "ab") as handle:
        handle.write(b'{"action":"message.post","agent":"ab')  # bytes without a newline
    # Only the last file may end torn (a crash mid-write); anywhere else it breaks the chain.
    result = verify(log_dir, archived=archived)
    assert not result.ok and not result.torn_tail
    assert (result.file, result.line) == (str(middle), count + 1)


async def test_restart_continues_the_chain_and_drops_a_torn_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="buzz_broker")
    directory = tmp_path / "audit"
    log = AuditLog.open(directory, rotate_bytes=4096)
    for i in range(20):
        await log.append(record(i))
    seq, head = log.head
    assert seq == 20
    await log.aclose()
    # A crash tore the next line mid-write (its append never returned).
    last = audit_files(directory)[-1][1]
    with open(last, "ab") as handle:
        handle.write(b'{"action":"message.post","agent":"ab')
    torn = verify(directory)
    assert torn.ok and torn.torn_tail and torn.records == 20

    log = AuditLog.open(directory, rotate_bytes=4096)
    assert log.head == (seq, head)
    assert "audit.torn_tail_dropped" in [r.__dict__.get("buzz_event") for r in caplog.records]
    for i in range(20, 40):
        await log.append(record(i))
    await log.aclose()
    result = verify(directory)
    assert result.ok and result.records == 40 and not result.torn_tail
    assert [e.record.request_id for e in read_records(directory) if isinstance(e.record, AuditRecord)] == [
        f"req-{i:05d}" for i in range(40)]


async def test_a_damaged_last_record_stops_the_open(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    log = AuditLog.open(directory, rotate_bytes=4096)
    await log.append(record(1))
    await log.append(record(2))
    await log.aclose()
    path = audit_files(directory)[-1][1]
    path.write_bytes(path.read_bytes().replace(b"req-00002", b"req-00009"))
    with pytest.raises(AuditUnavailable) as info:
        AuditLog.open(directory)
    assert str(info.value) == UNAVAILABLE_MESSAGE and "verify" in info.value.detail


async def test_concurrent_appends_keep_the_chain(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    log = await write_log(directory, 64 * 20, rotate=8192, concurrency=64)
    result = verify(directory)
    assert result.ok and result.records == 1280
    assert log.batches < 1280  # group commit shared fsyncs
    # Each task's records appear in the order that task appended them.
    order = [int(e.record.request_id[4:]) for e in read_records(directory) if isinstance(e.record, AuditRecord)]
    assert sorted(order) == list(range(1280))
    for task in range(64):
        mine = [i for i in order if i % 64 == task]
        assert mine == sorted(mine)


async def test_close_waits_for_queued_records(tmp_path: Path) -> None:
    log = AuditLog.open(tmp_path / "audit")
    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(log.append, record(i))
        await trio.testing.wait_all_tasks_blocked()
        await log.aclose()  # every caller already queued gets its durable answer
    result = verify(tmp_path / "audit")
    assert result.ok and result.records == 20 and result.head == log.head[1]


def _disk_full(fd: int, data: bytes) -> None:
    # Every write fails with ENOSPC: a full disk, whoever we run as. (A descriptor on
    # /dev/full no longer passes for the audit file: the path must name the open file.)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


async def test_full_disk_fails_closed(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.ERROR, logger="buzz_broker")
    monkeypatch.setattr("daemon.state.audit._write_all", _disk_full)
    log = AuditLog.open(tmp_path / "audit")
    with pytest.raises(AuditUnavailable) as info:
        await log.append(record(1))
    assert str(info.value) == UNAVAILABLE_MESSAGE
    assert "No space left on device" in info.value.detail
    events = [r.__dict__.get("buzz_event") for r in caplog.records]
    assert "audit.unavailable" in events
    # Concurrent appends in the same failing batch all fail; none is reported written.
    failures = []

    async def one(i: int) -> None:
        try:
            await log.append(record(i))
        except AuditUnavailable:
            failures.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(one, i)
    assert sorted(failures) == list(range(10))
    await log.aclose()
    with pytest.raises(AuditUnavailable):
        await log.append(record(2))  # closed


async def test_failed_fsync_leaves_no_torn_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "audit"
    log = AuditLog.open(directory)
    await log.append(record(1))
    real_fsync = os.fsync
    calls = {"n": 0}

    def flaky(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", flaky)
    with pytest.raises(AuditUnavailable):
        await log.append(record(2))  # its bytes reached the file, but were never durable
    monkeypatch.setattr(os, "fsync", real_fsync)
    await log.append(record(3))
    await log.aclose()
    result = verify(directory)
    assert result.ok and result.records == 2
    assert [e.record.request_id for e in read_records(directory) if isinstance(e.record, AuditRecord)] == [
        "req-00001", "req-00003"]


async def test_unwritable_paths_as_root_or_not(tmp_path: Path) -> None:
    # The file the log must write next is a directory: rotation cannot happen.
    directory = tmp_path / "audit"
    log = AuditLog.open(directory, rotate_bytes=1024)
    (directory / "audit-000002.jsonl").mkdir()
    failed = 0
    for i in range(10):
        try:
            await log.append(record(i))
        except AuditUnavailable:
            failed += 1
    assert failed > 0
    # Once the operator clears the way, appends continue on the same chain.
    (directory / "audit-000002.jsonl").rmdir()
    await log.append(record(99))
    await log.aclose()
    assert verify(directory).ok and verify(directory).records == 10 - failed + 1

    # Opening: the current file is a directory, or the audit directory is a file.
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "audit-000001.jsonl").mkdir()
    with pytest.raises(AuditUnavailable):
        AuditLog.open(blocked)
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(AuditUnavailable):
        AuditLog.open(tmp_path / "a-file")


async def test_no_argument_content_credential_or_secret(tmp_path: Path) -> None:
    store = SessionStore.open(tmp_path)
    cred, token = store.issue(agent=AGENT, channels=frozenset(
        {"123e4567-e89b-12d3-a456-426614174000"}), actions=frozenset({"message.post"}),
        ttl_seconds=None, uid=None, now=int(NOON))
    content = "the launch code is hunter2-7c1f9e"
    body = json.dumps({"type": "broker_request", "requestId": "r-secret-test",
                       "action": "message.post", "args": {"content": content}}).encode()
    log = AuditLog.open(tmp_path / "audit")
    common = dict(at=NOON, credential_id=cred, agent=AGENT, action="message.post",
                  request_id="r-secret-test",
                  body=BodyDigest.mac(BodyMac.open(tmp_path).of(body)))
    await log.append(AuditRecord(phase=Phase.INTENT, status=None, code=None,
                                 events=("ef" * 32,), **common))  # type: ignore[arg-type]
    await log.append(AuditRecord(phase=Phase.VERDICT, status=Status.SUCCEEDED, code=None,
                                 events=("ef" * 32,), **common))  # type: ignore[arg-type]
    await log.aclose()
    written = b"".join(p.read_bytes() for _, p in audit_files(tmp_path / "audit"))
    token_hash = hashlib.sha256(token.encode()).hexdigest()
    # Nor the body's unkeyed sha256, with which a guessed body is confirmed offline.
    for needle in (token, token[4:], token_hash, content, "hunter2", body.decode(),
                   hashlib.sha256(body).hexdigest()):
        assert needle.encode() not in written
    for line in written.splitlines():
        assert set(json.loads(line)) == {
            "v", "seq", "prev", "digest", "time", "phase", "credential", "agent", "action",
            "requestId", "bodyMac", "status", "code", "events", "replayed"}


#: Lines the version before body MACs wrote (`bodySha256`); vectors/README.md says how.
_GONE = object()  # a member a case removes
OLD_LINES = (Path(__file__).parent / "vectors" / "audit_before_body_mac.jsonl").read_bytes()


def _resealed(obj: dict[str, object]) -> bytes:
    """`obj` as a well-formed line: canonical JSON with its digest recomputed (an edit no
    digest catches, so what refuses it is the member rule alone)."""
    body = {k: v for k, v in obj.items() if k != "digest"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    obj = {**body, "digest": hashlib.sha256(canonical.encode()).hexdigest()}
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@pytest.mark.parametrize(("change", "kind"), [
    ({}, BodyKind.SHA256),  # as the version before wrote it
    ({"bodySha256": _GONE, "bodyMac": "5a" * 32}, BodyKind.MAC),  # as this one writes it
    ({"bodyMac": "5a" * 32}, None),  # both
    ({"bodySha256": _GONE}, None),  # neither
    ({"bodySha256": _GONE, "bodyMac": "5A" * 32}, None),  # not lowercase hex
    ({"bodySha256": _GONE, "bodyMac": "5a" * 31}, None),
    ({"bodySha256": _GONE, "bodyMac": ["5a" * 32]}, None),
    ({"bodySha256": _GONE, "bodyHmac": "5a" * 32}, None),  # a name of neither kind
    ({"dTag": _GONE, "bodySha256": _GONE, "bodyMac": "5a" * 32}, BodyKind.MAC),  # no dTag: fine
], ids=["old", "new", "both", "neither", "uppercase", "short", "list", "other-name",
        "new-without-dTag"])
def test_a_line_names_its_body_once_by_mac_or_old_sha256(
    tmp_path: Path, change: dict[str, object], kind: BodyKind | None,
) -> None:
    """The reader takes exactly one of `bodyMac` (written now) and `bodySha256` (written
    before), each 64 lowercase hex, and no other body member (docs/operations.md, "Fields")."""
    obj = json.loads(OLD_LINES.splitlines()[0])
    obj.update(change)
    obj = {k: v for k, v in obj.items() if v is not _GONE}
    (tmp_path / "audit-000001.jsonl").write_bytes(_resealed(obj) + b"\n")
    result = verify(tmp_path)
    if kind is None:
        assert not result.ok and result.line == 1 and "malformed record" in str(result.reason)
        assert [entry.record for entry in read_records(tmp_path)] == [None]
        return
    assert result.ok, result.reason
    [entry] = read_records(tmp_path)
    assert isinstance(entry.record, AuditRecord) and entry.record.body.kind is kind


async def test_a_record_is_never_written_with_an_unkeyed_digest(tmp_path: Path) -> None:
    """`append` refuses a record naming its body by sha256 (a bug: the pipeline records
    MACs), and writes nothing of it; the old kind is for reading old lines only."""
    log = AuditLog.open(tmp_path)
    old = dataclasses.replace(record(0), body=BodyDigest(kind=BodyKind.SHA256, hex="ab" * 32))
    with pytest.raises(ValueError, match="bodyMac"):
        await log.append(old)
    await log.append(record(1))
    await log.aclose()
    lines = [json.loads(line) for _, path in audit_files(tmp_path)
             for line in path.read_bytes().splitlines()]
    assert [(line["requestId"], "bodyMac" in line, "bodySha256" in line) for line in lines] == [
        ("req-00001", True, False)]


def test_records_validate_in_construction() -> None:
    good = record(0)
    for change in ({"phase": Phase.INTENT},  # an intent with a status
                   {"status": Status.SUCCEEDED, "code": ErrorCode.INTERNAL},
                   {"status": Status.FAILED, "code": ErrorCode.OUTCOME_UNKNOWN},
                   {"status": Status.FAILED, "code": None},
                   {"agent": "AB" * 32}, {"credential_id": "bzb_token"},
                   {"request_id": "has space"}, {"body": "00" * 32},
                   {"events": ("zz",)}, {"action": "Message Post"}, {"at": -1.0}):
        fields = {f: getattr(good, f) for f in good.__dataclass_fields__}
        fields.update(change)
        with pytest.raises((ValueError, TypeError)):
            AuditRecord(**fields)
    for kind, hex_ in ((BodyKind.MAC, "00"), (BodyKind.SHA256, "AB" * 32),
                       ("bodyMac", "ab" * 32)):
        with pytest.raises((ValueError, TypeError)):
            BodyDigest(kind=kind, hex=hex_)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AuditLog.open("/nonexistent-never", rotate_bytes=10)


# ---------------------------------------------------------------- issue 13: identity, anchor


@pytest.mark.parametrize("how", ["rename", "delete", "hard_link", "replace", "rename_dir",
                                 "rename_aside_then_create"])
async def test_the_path_must_still_name_the_open_file(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="buzz_broker")
    directory = tmp_path / "audit"
    log = AuditLog.open(directory)
    await log.append(record(1))
    live = audit_files(directory)[-1][1]
    aside = tmp_path / "aside.jsonl"
    if how == "rename":
        live.rename(aside)
    elif how == "delete":
        live.unlink()
    elif how == "hard_link":
        os.link(live, aside)
    elif how == "replace":
        # The same name, another file (a copy whose tail the editor controls).
        shutil.copy(live, aside)
        os.replace(aside, live)
    elif how == "rename_aside_then_create":
        # The open file keeps its one link under another name, and a new file takes the
        # path: only the (device, inode) comparison tells the two apart (issue 22).
        live.rename(aside)
        shutil.copy(aside, live)
    else:
        directory.rename(tmp_path / "moved")
    with pytest.raises(AuditUnavailable) as info:
        await log.append(record(2))
    assert "replaced" in info.value.detail
    assert "audit.unavailable" in [r.__dict__.get("buzz_event") for r in caplog.records]
    assert log.head[0] == 1  # nothing was counted as written
    await log.aclose()


async def test_a_renamed_file_put_back_continues_the_chain(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    log = AuditLog.open(directory)
    await log.append(record(1))
    live = audit_files(directory)[-1][1]
    live.rename(tmp_path / "aside.jsonl")
    with pytest.raises(AuditUnavailable):
        await log.append(record(2))
    (tmp_path / "aside.jsonl").rename(live)
    await log.append(record(3))
    await log.aclose()
    assert verify(directory).ok and verify(directory).records == 2


async def _anchored_log(directory: Path, count: int) -> tuple[int, str]:
    log = AuditLog.open(directory, rotate_bytes=4096)
    for i in range(count):
        await log.append(record(i))
    await log.aclose()
    return log.head


async def test_open_refuses_a_log_that_does_not_reach_its_anchor(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    anchor = await _anchored_log(directory, 30)
    middle = (10, verify_head_at(directory, 10))
    # Reaching the anchor, at the tail or before it, opens; the records after it are checked.
    for good in (anchor, middle, (0, GENESIS)):
        AuditLog.open(directory, anchor=good)._close_fd()
    last = audit_files(directory)[-1][1]
    pristine = last.read_bytes()
    lines = pristine.splitlines(keepends=True)

    # A cut tail: a valid shorter chain.
    last.write_bytes(b"".join(lines[:-1]))
    assert verify(directory).ok
    with pytest.raises(AuditUnavailable) as info:
        AuditLog.open(directory, anchor=anchor)
    assert "anchored head" in info.value.detail
    result = verify(directory, anchor=anchor)
    assert not result.ok and "anchored head" in str(result.reason)

    # A suffix rewritten consistently (digests and links recomputed) from record 26 on:
    # the same first 25 records, then five others. Each line is valid, the chain holds.
    shutil.rmtree(directory)
    log = AuditLog.open(directory, rotate_bytes=4096)
    for i in range(30):
        await log.append(record(i) if i < 25 else record(i, action="agents.delete"))
    await log.aclose()
    assert verify(directory).ok and log.head[0] == anchor[0] and log.head[1] != anchor[1]
    with pytest.raises(AuditUnavailable) as info:
        AuditLog.open(directory, anchor=anchor)
    assert "not the anchored head" in info.value.detail
    assert not verify(directory, anchor=anchor).ok
    # What the anchor cannot show: a rewrite after the anchored record (anchor at 10).
    AuditLog.open(directory, anchor=middle)._close_fd()

    # A deleted log: the directory comes back empty.
    shutil.rmtree(directory)
    with pytest.raises(AuditUnavailable):
        AuditLog.open(directory, anchor=anchor)
    assert not verify(directory, anchor=anchor).ok


def verify_head_at(directory: Path, seq: int) -> str:
    """The hash of record `seq` (what an anchor taken then would hold)."""
    lines = [line for _n, p in audit_files(directory) for line in p.read_bytes().splitlines()]
    return hashlib.sha256(lines[seq - 1]).hexdigest()


async def test_one_writer_per_log(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    log = AuditLog.open(directory)
    with pytest.raises(AuditUnavailable) as info:
        AuditLog.open(directory)  # a second daemon, or `audit reanchor` while one serves
    assert "another process" in info.value.detail
    await log.aclose()
    AuditLog.open(directory)._close_fd()


async def test_refusal_counts_and_reanchor_records_chain(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    log = AuditLog.open(directory)
    await log.append(record(0))
    await log.append(RefusalCount(at=NOON + 60, since=NOON, credential_id=CRED, agent=AGENT,
                                  action="message.post", code=ErrorCode.UNAUTHORIZED, count=4980))
    await log.append(Reanchor(at=NOON + 61, anchored_seq=9, anchored_head="cd" * 32, uid=0))
    await log.aclose()
    assert verify(directory).ok and verify(directory).records == 3
    entries = [line.record for line in read_records(directory)]
    assert isinstance(entries[1], RefusalCount) and entries[1].count == 4980
    assert isinstance(entries[2], Reanchor) and entries[2].anchored_seq == 9
    for bad in ({"count": 0}, {"code": ErrorCode.OUTCOME_UNKNOWN}, {"agent": "x"}):
        fields = {"at": NOON, "since": NOON, "credential_id": CRED, "agent": AGENT,
                  "action": None, "code": ErrorCode.UNAUTHORIZED, "count": 1, **bad}
        with pytest.raises((ValueError, TypeError)):
            RefusalCount(**fields)


def test_an_archived_head_of_the_series_verifies_only_when_said(log_dir: Path) -> None:
    whole = verify(log_dir)
    files = audit_files(log_dir)
    archive = log_dir.parent / "archive"
    archive.mkdir()
    files[0][1].rename(archive / files[0][1].name)
    assert not verify(log_dir).ok  # audit-000001.jsonl is missing
    rest = verify(log_dir, archived=True, anchor=(1000, whole.head))
    assert rest.ok and rest.head == whole.head and rest.records < 1000
    # The archive verifies on its own, and the files left still form one chain with it.
    assert verify(archive / files[0][1].name).ok
    # What the anchor still catches: the newest file gone.
    files[-1][1].unlink()
    assert not verify(log_dir, archived=True, anchor=(1000, whole.head)).ok


def test_a_head_before_the_first_record_checked_is_not_vouched_for(log_dir: Path) -> None:
    files = audit_files(log_dir)
    first_line = files[0][1].read_bytes().splitlines()[0]
    record_1 = (1, hashlib.sha256(first_line).hexdigest())
    assert verify(log_dir, contains=record_1).ok
    archive = log_dir.parent / "archive"
    archive.mkdir()
    files[0][1].rename(archive / files[0][1].name)
    lone = files[-1][1]
    # Record 1 is archived away (or not in a lone later file): nothing here can vouch for it.
    for path, archived in ((log_dir, True), (lone, False)):
        for result in (verify(path, archived=archived, contains=record_1),
                       verify(path, archived=archived, anchor=record_1)):
            assert not result.ok and result.file is None, (path, result)
    # The record just before the first one present: its hash is that record's prev, and
    # another hash is refused, not taken on trust.
    kept = json.loads(files[1][1].read_bytes().splitlines()[0])
    before = kept["seq"] - 1
    assert verify(log_dir, archived=True, contains=(before, kept["prev"])).ok
    refused = verify(log_dir, archived=True, contains=(before, "cd" * 32))
    assert not refused.ok and refused.file is None
