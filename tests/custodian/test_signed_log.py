"""The custodian's hash-chained log (custody/custodian/ledger.py) survives a crash
mid-write and a write that fails: a torn last line is cut at open (and said), and a failed
append leaves the file and the head as they were, so the chain goes on verifying.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import coincurve
import pytest
import trio
import trio.testing

from custody import TokenConfig
from custody.custodian import server
from custody.custodian.client import CALL_TIMEOUT, CustodianClient
from custody.custodian.ledger import SignLog
from custody.custodian.verify import verify_chain
from custody.custodian.messages import BadMessage
from custody.custodian.server import LOCK_POLL_SECONDS, LOCK_WAIT_SECONDS, Custodian, appended
from tests.custodian.test_refusals import intent
from tests.fixtures.custodian import CustodianProcess

REPO = Path(__file__).resolve().parents[2]


def _sign_one(socket: Path, agent: str) -> None:
    from tests.custodian.test_refusals import ask

    ok, signed = ask(socket, "sign", events=[intent(agent, 9, [["h", "c"]], "hi")])
    assert ok, signed


async def test_a_torn_last_line_is_cut_at_start_and_the_chain_goes_on(
        custodian: CustodianProcess) -> None:
    client = await CustodianClient.open(custodian.socket)
    owner = coincurve.PrivateKey().public_key_xonly.format().hex()
    agent = (await client.import_agent(
        bytearray(coincurve.PrivateKey().secret.hex().encode()), owner=owner)).pubkey
    _sign_one(custodian.socket, agent)
    await client.aclose()
    custodian.stop()
    log = custodian.config.parent / "state" / "custodian" / "signed.jsonl"
    whole = log.read_bytes()
    lines = verify_chain(log)
    # what a SIGKILL in the middle of a write leaves: part of a line, no newline
    torn = whole.splitlines(keepends=True)[-1][:57]
    log.write_bytes(whole + torn)
    custodian.start()  # before: json.loads of the torn line, and the custodian never starts
    _sign_one(custodian.socket, agent)
    stderr = custodian.stop()
    assert f"cut a torn last line ({len(torn)} bytes" in stderr, stderr[-2000:]
    assert log.read_bytes().startswith(whole)
    assert verify_chain(log) == lines + 1
    assert json.loads(log.read_bytes().splitlines()[-1])["seq"] == lines + 1


#: In a child process (RLIMIT_FSIZE is the whole process's): a log of one line, then an
#: append the file-size limit cuts short part way (EFBIG, the rest unwritten), then one
#: with the limit lifted. Prints the file's bytes after the failure, and the final file.
_CHILD = textwrap.dedent("""
    import json, resource, signal, sys
    from pathlib import Path
    from custody.custodian.ledger import SignLog
    path = Path(sys.argv[1])
    log = SignLog(path, 1 << 20)
    log.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "1" * 64}])
    before = path.read_bytes()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 40, resource.RLIM_INFINITY))
    try:
        log.append([{"op": "sign", "agent": "b" * 64, "kind": 9, "id": "2" * 64}])
        failed = None
    except OSError as exc:
        failed = exc.errno
    after_failure = path.read_bytes()
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    log.append([{"op": "sign", "agent": "c" * 64, "kind": 9, "id": "3" * 64}])
    log.close()
    print(json.dumps({"failed": failed, "unchanged": after_failure == before}))
""")


@pytest.mark.token_independent
def test_a_failed_append_leaves_the_file_and_the_head_as_they_were(tmp_path: Path) -> None:
    path = tmp_path / "signed.jsonl"
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["failed"] is not None, "the size limit made the write fail"
    # before: 40 bytes of the failed line were on disk (a torn line; after a crash there
    # the custodian would not start), and its entry was written later after all, although
    # its request had been answered `internal`
    assert seen["unchanged"], "the failed write was cut off again"
    entries = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert [(e["seq"], e["id"][0]) for e in entries] == [(1, "1"), (2, "3")]
    assert verify_chain(path) == 2


def test_a_line_holds_hash_last_and_an_older_log_goes_on(tmp_path: Path) -> None:
    """The line is its hashed body with `hash` appended (one encoding an entry); a log whose
    lines hold `hash` among the sorted keys, as older versions wrote, still checks, and the
    chain goes on from it."""
    import hashlib

    from custody.custodian.ledger import GENESIS, SignLog

    log = tmp_path / "signed.jsonl"
    old = {"seq": 1, "at": 1_700_000_000, "prev": GENESIS, "op": "mint", "agent": "a" * 64}
    body = json.dumps(old, separators=(",", ":"), sort_keys=True)
    old["hash"] = hashlib.sha256(bytes.fromhex(GENESIS) + body.encode()).hexdigest()
    log.write_text(json.dumps(old, separators=(",", ":"), sort_keys=True) + "\n")
    signed = SignLog(log, 1 << 20)
    signed.append([{"op": "sign", "agent": "b" * 64, "kind": 9, "id": "c" * 64}])
    signed.close()
    first, second = log.read_text().splitlines()
    assert list(json.loads(first)).index("hash") < len(json.loads(first)) - 1  # sorted in
    assert list(json.loads(second))[-1] == "hash"
    assert json.loads(second)["prev"] == old["hash"]
    assert verify_chain(log) == 2
    # A line changed after the fact breaks the chain, whichever way its keys are written.
    log.write_text(first + "\n" + second.replace('"kind":9', '"kind":1') + "\n")
    with pytest.raises(ValueError, match="line 2"):
        verify_chain(log)


async def test_a_request_that_changes_nothing_writes_no_line(
        custodian: CustodianProcess) -> None:
    """A mint_ref used before, a destroy of a destroyed key, the same tag attached again:
    each answers as before, and adds no line to the signed log or the journal. (A review: a
    mint replayed after a destroy read as the key minted again, and these lines, unlike
    refusals, had no bound.)"""
    from buzzwire.nostr import owner_tag_digest

    client = await CustodianClient.open(custodian.socket)
    owner_key = coincurve.PrivateKey()
    owner = owner_key.public_key_xonly.format().hex()
    agent = (await client.mint_agent(owner=owner, mint_ref="r1")).pubkey
    sig = owner_key.sign_schnorr(owner_tag_digest(agent, ""), b"\x00" * 32)
    tag = ["auth", owner, "", sig.hex()]
    for _ in range(2):
        assert (await client.attach_auth_tag(agent, tag)).auth_tag == tuple(tag)
    gone = await client.destroy_agent(agent)
    for _ in range(2):
        again = await client.mint_agent(owner=owner, mint_ref="r1")
        assert (again.pubkey, again.deleted_at) == (agent, gone.deleted_at)
        assert (await client.destroy_agent(agent)).deleted_at == gone.deleted_at
    await client.aclose()
    stderr = custodian.stop()
    log = custodian.config.parent / "state" / "custodian" / "signed.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["op"], e.get("for")) for e in entries if e.get("agent") == agent] == [
        ("mint", None), ("intent", "attach_auth"), ("attach_auth", None),
        ("intent", "destroy"), ("destroy", None)]
    assert [e.get("for") for e in entries if e["op"] == "intent"] == [
        "mint", "attach_auth", "destroy"]
    # Changes are lines of the signed log only, not of the journal (test_refusals.py,
    # `test_a_flood_of_changes_costs_the_custodians_journal_no_line_each`).
    assert agent not in stderr, stderr[-2000:]


def _three_lines(path: Path) -> list[str]:
    from custody.custodian.ledger import SignLog

    log = SignLog(path, 1 << 20, clock=lambda: 1_700_000_000)
    for n in "123":
        log.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": n * 64}])
    log.close()
    return path.read_text().splitlines()


@pytest.mark.token_independent
@pytest.mark.parametrize(("kept", "broken"), [
    pytest.param((1, 2), 1, id="the first line cut"),  # the second names it as `prev`
    pytest.param((0, 2), 2, id="a middle line cut"),
    pytest.param((1, 0, 2), 1, id="two lines swapped"),
])
def test_each_line_chains_to_the_line_before_it(tmp_path: Path, kept: tuple[int, ...],
                                                broken: int) -> None:
    """A line's own hash is not enough: its `prev` must be the hash of the line before it
    (GENESIS, or the `start` given, for the first), so lines cut or moved break the chain
    although every line is whole."""
    path = tmp_path / "signed.jsonl"
    lines = _three_lines(path)
    assert verify_chain(path) == 3
    path.write_text("".join(lines[i] + "\n" for i in kept))
    with pytest.raises(ValueError, match=f"line {broken} breaks the chain"):
        verify_chain(path)
    # the same lines from where they were cut: what a moved-away older file leaves
    path.write_text("".join(line + "\n" for line in lines[1:]))
    assert verify_chain(path, start=json.loads(lines[0])["hash"]) == 2


@pytest.mark.token_independent
def test_the_log_directory_is_the_custodians_alone(tmp_path: Path) -> None:
    """The log's directory (`destroyed/` sits in it too) is made 0700 whatever the umask."""
    import os
    import stat

    old = os.umask(0)
    try:
        _three_lines(tmp_path / "log" / "signed.jsonl")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "log").stat().st_mode) == 0o700



async def test_an_effect_whose_line_fails_is_owed_and_refuses_more_until_written(
        custodian: CustodianProcess) -> None:
    """The log at the custodian's file-size limit (RLIMIT_FSIZE, as a full disk). With no
    room for a destroy's intent line custody is not asked: the key stays. With room for
    the intent only, the destroy is done but its line cannot be written. That line is
    owed: the retry, a sign and a mint are refused naming the log's fault, lookups still
    answer, and once the log can be written the line is, before any other. (A review: the
    retry answered the record, as for a key destroyed before, and the destroy never had a
    line; a compromised pipeline filling the disk could arrange that at will.)"""
    import resource

    import time

    from custody.custodian.ledger import SignLog, hashed_line
    from tests.custodian.test_refusals import ask, human

    client = await CustodianClient.open(custodian.socket)
    owner = human()
    victim, other = [(await client.import_agent(
        bytearray(coincurve.PrivateKey().secret.hex().encode()), owner=owner)).pubkey
        for _ in range(2)]
    await client.aclose()
    custodian.stop()
    log = custodian.config.parent / "state" / "custodian" / "signed.jsonl"
    filler = SignLog(log, 1 << 30)  # 1 MiB of lines: the keystore's files stay below it
    filler.append([{"op": "decrypt", "agent": other, "count": 0}] * 10_000)
    filler.close()
    custodian.start()
    assert custodian.proc is not None
    pid = custodian.proc.pid

    def room_for_intent(agent: str) -> None:  # the file-size limit: the intent's line fits
        last = json.loads(log.read_text().splitlines()[-1])
        body, _ = hashed_line(last["hash"], {"seq": last["seq"] + 1, "prev": last["hash"],
                                         "at": int(time.time()), "op": "intent",
                                         "for": "destroy", "agent": agent})
        room = log.stat().st_size + len(body) + len(',"hash":""\n') + 64
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (room, resource.RLIM_INFINITY))

    resource.prlimit(pid, resource.RLIMIT_FSIZE, (log.stat().st_size, resource.RLIM_INFINITY))
    internal = (False, ("internal", "custodian fault"))
    assert ask(custodian.socket, "destroy", pubkey=victim) == internal
    assert ask(custodian.socket, "agent", pubkey=victim, include_deleted=False)[0]
    room_for_intent(victim)
    assert ask(custodian.socket, "destroy", pubkey=victim) == internal
    ok, record = ask(custodian.socket, "agent", pubkey=victim, include_deleted=True)
    assert ok and isinstance(record, dict) and record["deleted_at"] is not None
    refusal = (False, ("custody", "the custodian's log cannot be written: OSError EFBIG"))
    assert ask(custodian.socket, "destroy", pubkey=victim) == refusal
    assert ask(custodian.socket, "mint", owner=owner, mint_ref=None) == refusal
    assert ask(custodian.socket, "sign", events=[intent(other, 9, [["h", "c"]])]) == refusal
    assert ask(custodian.socket, "agent", pubkey=other, include_deleted=False)[0]

    resource.prlimit(custodian.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    assert ask(custodian.socket, "sign", events=[intent(other, 9, [["h", "c"]])])[0]
    *_, began, destroyed, signed = [json.loads(line) for line in log.read_text().splitlines()]
    assert (began["op"], began["for"], began["agent"]) == ("intent", "destroy", victim)
    assert (destroyed["op"], destroyed["agent"], destroyed["intent"], signed["op"]) == (
        "destroy", victim, began["seq"], "sign")
    assert verify_chain(log) == 10_007  # the two imports: intent and outcome each

    # A stop while a line is still owed: it goes to the journal, the process's stderr.
    room_for_intent(other)
    assert not ask(custodian.socket, "destroy", pubkey=other)[0]
    stderr = custodian.stop()
    assert "custodian fault in destroy: OSError EFBIG" in stderr, stderr[-2000:]
    assert f'a line owed, never written: {{"agent": "{other}"' in stderr, stderr[-2000:]


#: In a child process: a log bound at two lines, the second written with no descriptor left
#: (RLIMIT_NOFILE), so the file the move to `.1` leaves to open cannot be opened; the
#: fourth with descriptors again. Prints what each append did.
_MOVE = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from custody.custodian.ledger import SignLog
    log = SignLog(Path(sys.argv[1]), 500)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    done = []
    for n in "1234":
        if n in "24":  # descriptors 0-2 only, then as before
            resource.setrlimit(resource.RLIMIT_NOFILE, (3, limits[1]) if n == "2" else limits)
        try:
            log.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": n * 64}])
            done.append("ok")
        except Exception as exc:
            done.append(f"{type(exc).__name__} {getattr(exc, 'errno', None)}")
    log.close()
    print(json.dumps(done))
""")


@pytest.mark.token_independent
def test_a_new_file_the_move_cannot_open_is_opened_at_a_later_line(tmp_path: Path) -> None:
    """The log moves to `.1` past its bound; opening the new file fails (no descriptor,
    no inode left): the next line's write fails, and a later one opens it. (A review: the
    log kept the closed file, and every later line failed with ValueError, answered
    `invalid`, until a restart.)"""
    import errno

    path = tmp_path / "signed.jsonl"
    done = subprocess.run([sys.executable, "-c", _MOVE, str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["ok", "ok", f"OSError {errno.EMFILE}", "ok"]
    moved = path.with_name("signed.jsonl.1")
    assert verify_chain(moved) == 2
    last = json.loads(moved.read_text().splitlines()[-1])
    assert verify_chain(path, start=last["hash"]) == 1
    assert json.loads(path.read_text())["id"] == "4" * 64


@pytest.mark.token_independent
def test_a_line_is_on_disk_before_append_returns_and_a_failed_sync_moves_no_head(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each append ends with one fdatasync of the log covering every byte it wrote (a batch
    of lines, one sync), before it returns and so before any answer that waits on it; a
    sync that fails is a write that fails: cut off, the head where it was. (A review: the
    keystore's change was synced and its line only written, so a power cut after the
    answer could keep a mint or a destroy, or a delivered signature, and lose its line.)"""
    import errno
    import os

    from custody.custodian.ledger import SignLog

    path = tmp_path / "signed.jsonl"
    synced: list[tuple[int, int]] = []  # (inode, size) of each file synced
    fail = [False]
    real = os.fdatasync

    def spy(fd: int) -> None:
        if fail[0]:
            raise OSError(errno.EIO, "injected")
        real(fd)
        synced.append((os.fstat(fd).st_ino, os.fstat(fd).st_size))

    monkeypatch.setattr(os, "fdatasync", spy)
    log = SignLog(path, 1 << 20)
    log.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": n * 64} for n in "12"])
    assert synced == [(path.stat().st_ino, path.stat().st_size)]  # two lines, one sync
    log.append([])  # nothing owed: nothing written, nothing synced
    assert len(synced) == 1
    before, head = path.read_bytes(), log.head
    fail[0] = True
    with pytest.raises(OSError):
        log.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "3" * 64}])
    assert (path.read_bytes(), log.head) == (before, head)
    fail[0] = False
    log.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "4" * 64}])
    log.close()
    assert synced[-1] == (path.stat().st_ino, path.stat().st_size)
    assert verify_chain(path) == 3


@pytest.mark.parametrize("last", [
    pytest.param(b'{"seq": 4, "hash": "' + b"a" * 30 + b"\n", id="not JSON"),
    pytest.param(b"[4]\n", id="not an object"),
    pytest.param(b'{"seq": 4, "prev": "' + b"0" * 64 + b'"}\n', id="without its hash"),
])
def test_a_log_whose_last_line_is_not_its_own_refuses_the_start_in_one_line(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path, last: bytes) -> None:
    """The custodian goes on from its log's last line: one that is no line of the log
    cannot be gone on from. One line on stderr, exit 1, the file left as it was. (A
    review: not JSON, or without `hash`, was a traceback; not an object restarted the
    chain from GENESIS, as a fork.)"""
    import os

    from tests.fixtures.custodian import write_custodian_config

    token, state = custody_state
    path = state / "custodian" / "signed.jsonl"
    _three_lines(path)
    path.write_bytes(path.read_bytes() + last)
    written = path.read_bytes()
    config = write_custodian_config(tmp_path / "custodian.toml", token=token, state_dir=state,
                                    socket=tmp_path / "c.sock", relay_url="ws://127.0.0.1:1")
    env = dict(os.environ)
    env.pop("CREDENTIALS_DIRECTORY", None)
    proc = subprocess.Popen([sys.executable, "-m", "custody.custodian", str(config)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "", "it started"
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        _, stderr = proc.communicate()
    assert stderr.splitlines() == [stderr.strip()] and "Traceback" not in stderr, stderr
    assert stderr.startswith(f"custodian: signed log {path}: its last line is not a line")
    assert path.read_bytes() == written


#: In a child process: `count` appends of one to three lines each on the log at argv[1]
#: (bound argv[2] bytes), as one writer of several; prints the seqs it was given.
_WRITER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from custody.custodian.ledger import SignLog
    log = SignLog(Path(sys.argv[1]), int(sys.argv[2]))
    seqs = []
    for n in range(int(sys.argv[3])):
        seqs.append(log.append([{"op": "sign", "agent": sys.argv[4] * 64, "kind": 9,
                                 "id": f"{n:064x}"}] * (1 + n % 3)))
    log.close()
    print(json.dumps(seqs))
""")


def _chained_across_the_move(path: Path) -> list[dict[str, Any]]:
    """The lines of `.1` then of `path`, each checked against the line before it (the
    first of `.1` against the `prev` it names: older lines are gone)."""
    moved = path.with_name(path.name + ".1")
    older = [json.loads(line) for line in moved.read_text().splitlines()] \
        if moved.exists() else []
    start = older[0]["prev"] if older else "0" * 64
    if older:
        assert verify_chain(moved, start=start) == len(older)
        start = older[-1]["hash"]
    newer = [json.loads(line) for line in path.read_text().splitlines()]
    assert verify_chain(path, start=start) == len(newer)
    return older + newer


@pytest.mark.token_independent
@pytest.mark.parametrize("bound", [pytest.param(1 << 30, id="one file"),
                                   pytest.param(20_000, id="moved to .1 many times")])
def test_writers_in_several_processes_keep_one_chain(tmp_path: Path, bound: int) -> None:
    """The serving custodian and `--recover` or `--forget-destroyed` beside it append to
    one log: four processes appending at once give every line its own seq, each chained
    to the line before it, across the moves to `.1` too. (A review: each writer chained to
    the head it held in memory, so a second writer's lines took seqs already written and
    the chain broke, as tampering would leave it; so the commands wrote no line at all.)"""
    path = tmp_path / "signed.jsonl"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(bound), "150",
                                 name], cwd=REPO, stdout=subprocess.PIPE, text=True)
               for name in "abcd"]
    given = [json.loads(w.communicate(timeout=120)[0]) for w in writers]
    assert [w.returncode for w in writers] == [0] * 4
    total = 4 * sum(1 + n % 3 for n in range(150))
    lines = _chained_across_the_move(path)
    assert [e["seq"] for e in lines] == list(range(total - len(lines) + 1, total + 1))
    assert len({seq for seqs in given for seq in seqs}) == 4 * 150  # no seq given twice
    if bound == 1 << 30:  # nothing moved away
        assert len(lines) == total and {e["agent"][0] for e in lines} == set("abcd")


#: In a child process: the log opened and one line appended, while the test holds the
#: log's lock with part of a line written, as another writer between its write and its sync.
_LATE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from custody.custodian.ledger import SignLog
    print("opening", flush=True)
    log = SignLog(Path(sys.argv[1]), 1 << 20)
    log.append([{"op": "intent", "for": "recover", "agent": "b" * 64}])
    log.close()
""")


@pytest.mark.token_independent
def test_a_writer_opening_while_another_writes_cuts_no_line_of_it(tmp_path: Path) -> None:
    """A log opened while another process is half way through its append (its line not
    yet whole) waits for that append, and cuts nothing: the torn-tail cut is for what a
    crash left, and only a writer holding the lock may tell the two apart. (A review: the
    open cut the other writer's unfinished line, which the other then finished as a line
    without its start.)"""
    import fcntl
    import time

    from custody.custodian.ledger import GENESIS, hashed_line

    path = tmp_path / "signed.jsonl"
    body, digest = hashed_line(GENESIS, {"seq": 1, "prev": GENESIS, "at": 1_700_000_000,
                                     "op": "sign", "agent": "a" * 64, "kind": 9,
                                     "id": "1" * 64})
    line = f'{body[:-1]},"hash":"{digest}"}}\n'.encode()
    with open(path, "ab", buffering=0) as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        writer.write(line[:40])
        late = subprocess.Popen([sys.executable, "-c", _LATE, str(path)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert late.stdout is not None and late.stdout.readline() == "opening\n"
            time.sleep(1.0)  # its open, then its append, well under way
            assert late.poll() is None, late.communicate()  # waiting for the lock
            assert path.read_bytes() == line[:40]  # before: cut to nothing at its open
            writer.write(line[40:])
            os.fdatasync(writer.fileno())
            fcntl.flock(writer.fileno(), fcntl.LOCK_UN)
            _, stderr = late.communicate(timeout=60)
        finally:
            if late.poll() is None:
                late.kill()
                late.communicate()
    assert late.returncode == 0 and "cut a torn" not in stderr, stderr
    assert verify_chain(path) == 2
    assert [json.loads(x)["seq"] for x in path.read_bytes().splitlines()] == [1, 2]


@pytest.mark.token_independent
def test_owed_lines_are_chained_after_another_writers_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line owed (its effect made, its write failed) is written at a later append after
    whatever another writer appended meanwhile, chained to that: seqs are given when the
    lines are written, under the lock, not when they were first asked for."""
    path = tmp_path / "signed.jsonl"
    server = _owing(SignLog(path, 1 << 20), {"op": "destroy", "agent": "a" * 64, "intent": 0},
                    monkeypatch)
    command = SignLog(path, 1 << 20)
    assert command.append([{"op": "intent", "for": "recover", "agent": "b" * 64}]) == 1
    assert command.append([{"op": "recover", "agent": "b" * 64, "intent": 1}]) == 2
    assert server.append([{"op": "sign", "agent": "c" * 64, "kind": 9, "id": "3" * 64}]) == 4
    server.close()
    command.close()
    assert verify_chain(path) == 4
    assert [json.loads(x)["op"] for x in path.read_bytes().splitlines()] == [
        "intent", "recover", "destroy", "sign"]


def test_a_writer_stopped_holding_the_lock_holds_no_lookup_and_no_stop(
        custodian: CustodianProcess) -> None:
    """A command beside the custodian (`--recover`, `--forget-destroyed`, under its uid)
    stopped (SIGSTOP, Ctrl-Z) while it holds the log's flock, which this test holds for
    it: a `sign` waits for the lock, meanwhile the lookups answer, and once it is let go
    the sign is answered after its line is written. Held again, a SIGTERM ends the
    custodian at once, exit 0, a waiting sign unanswered. The chain verifies. (A review:
    the flock was waited for on the event loop, so once one row waited nothing else was
    answered, not even the SIGTERM, until the writer went on.)"""
    import fcntl
    import signal
    import threading
    import time

    from tests.custodian.test_refusals import ask, human

    ok, made = ask(custodian.socket, "mint", owner=human(), mint_ref=None)
    assert ok and isinstance(made, dict)
    agent = made["pubkey"]
    log = custodian.config.parent / "state" / "custodian" / "signed.jsonl"
    answers: list[tuple[bool, object]] = []

    def sign() -> None:
        try:
            answers.append(ask(custodian.socket, "sign",
                               events=[intent(agent, 9, [["h", "c"]], "held")]))
        except (OSError, BadMessage):  # closed with no answer (an empty frame)
            answers.append((False, "closed"))

    with open(log, "ab") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        waiting = threading.Thread(target=sign)
        waiting.start()
        try:
            time.sleep(0.5)  # the sign signed, its line waiting for the lock
            began = time.monotonic()
            ok, version = ask(custodian.socket, "records_version")
            assert ok and isinstance(version, int)
            ok, record = ask(custodian.socket, "agent", pubkey=agent, include_deleted=False)
            assert ok and isinstance(record, dict) and record["pubkey"] == agent
            assert time.monotonic() - began < 1.0  # before: no answer at all
            assert answers == [] and waiting.is_alive()  # no answer before its line
        finally:
            fcntl.flock(writer.fileno(), fcntl.LOCK_UN)
            waiting.join(15)
    assert len(answers) == 1 and answers[0][0], answers
    assert json.loads(log.read_bytes().splitlines()[-1])["op"] == "sign"

    with open(log, "ab") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        waiting = threading.Thread(target=sign)
        waiting.start()
        try:
            time.sleep(0.5)
            assert custodian.proc is not None
            custodian.proc.send_signal(signal.SIGTERM)
            assert custodian.proc.wait(3) == 0  # before: still running, the lock held
            waiting.join(15)
        finally:
            fcntl.flock(writer.fileno(), fcntl.LOCK_UN)
    assert answers[1:] == [(False, "closed")]  # the second sign: unanswered, no line
    lines = verify_chain(log)
    assert json.loads(log.read_bytes().splitlines()[-1])["op"] == "sign" and lines > 1


@pytest.mark.token_independent
async def test_a_row_waits_for_the_lock_a_bounded_time_and_its_done_lines_stay_owed(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """The serving custodian's log (`wait=False`) waits for another writer's lock by
    trying again (server.py `appended`), the event loop free meanwhile, for up to
    LOCK_WAIT_SECONDS: then BlockingIOError (answered `internal`), nothing written, a
    change's lines owed. Once the lock is let go, the owed lines are written first, once."""
    path = tmp_path / "signed.jsonl"
    log = SignLog(path, 1 << 20, wait=False)
    await appended(log, [{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "1" * 64}])
    with open(path, "ab") as other:  # another open file: another writer, to flock
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        began = trio.current_time()
        with pytest.raises(BlockingIOError):
            await appended(log, [{"op": "destroy", "agent": "b" * 64, "intent": 1}], done=True)
        assert trio.current_time() - began >= LOCK_WAIT_SECONDS
        with pytest.raises(BlockingIOError):  # a row's own line, not owed
            await appended(log, [{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "2" * 64}])

        async def let_go() -> None:
            await trio.sleep(1)
            fcntl.flock(other.fileno(), fcntl.LOCK_UN)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(let_go)
            await appended(log, [{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "3" * 64}])
    log.close()
    assert verify_chain(path) == 3
    assert [(e["op"], e.get("id", "")[:1]) for e in map(json.loads, path.read_bytes().splitlines())
            ] == [("sign", "1"), ("destroy", ""), ("sign", "3")]


@pytest.mark.token_independent
def test_a_log_moved_by_another_writer_is_read_again_even_at_the_size_this_writer_left(
        tmp_path: Path) -> None:
    """The file is not as this writer left it when either its inode or its size differs:
    another writer moved it to `.1` and wrote a new file that happens to end at the very
    size this writer's own file had. Compared by size alone, the head held in memory (seq
    1) would be taken for the file's, and the next line would fork the chain."""
    from custody.custodian.ledger import SignLog

    path = tmp_path / "signed.jsonl"
    entry = {"op": "sign", "agent": "a" * 64, "kind": 9, "id": "1" * 64}
    server = SignLog(path, 1 << 20, clock=lambda: 1_700_000_000)
    assert server.append([entry]) == 1
    one_line = path.stat().st_size
    # A command beside it whose bound one line fits under and two do not: its first line
    # moves the file (seq 1, 2) to `.1`, its second is a new file of one line (seq 3).
    command = SignLog(path, one_line + 1, clock=lambda: 1_700_000_000)
    assert command.append([entry]) == 2
    assert command.append([entry]) == 3
    command.close()
    assert path.stat().st_size == one_line  # the size the server left, another inode
    assert server.append([entry]) == 4
    server.close()
    moved = path.with_name(path.name + ".1")
    older = [json.loads(x) for x in moved.read_text().splitlines()]
    newer = [json.loads(x) for x in path.read_text().splitlines()]
    assert [e["seq"] for e in older + newer] == [1, 2, 3, 4]
    assert verify_chain(moved) == 2
    assert verify_chain(path, start=older[-1]["hash"]) == 2


def _torn(path: Path) -> bytes:
    """One whole line of this log, then the start of another (a crash mid-write)."""
    from custody.custodian.ledger import GENESIS, hashed_line

    body, digest = hashed_line(GENESIS, {"seq": 1, "prev": GENESIS, "at": 1_700_000_000,
                                     "op": "sign", "agent": "a" * 64, "kind": 9,
                                     "id": "1" * 64})
    whole = f'{body[:-1]},"hash":"{digest}"}}\n'.encode()
    path.write_bytes(whole + b'{"seq":2,"prev":"')
    return whole


@pytest.mark.token_independent
def test_a_torn_tail_is_cut_and_said_when_the_log_is_opened(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Opened, before any line: the torn tail a crash left is cut and said then (the
    custodian's start, where the operator looks), not at some later first line."""
    from custody.custodian.ledger import SignLog

    path = tmp_path / "signed.jsonl"
    whole = _torn(path)
    with caplog.at_level("WARNING", logger="buzz_broker.custodian"):
        log = SignLog(path, 1 << 20)
    try:
        assert path.read_bytes() == whole
        assert log.seq == 1
        assert any("cut a torn last line" in r.getMessage() for r in caplog.records)
    finally:
        log.close()


@pytest.mark.token_independent
def test_a_broken_last_line_refuses_the_open_and_leaves_even_a_torn_tail_as_it_was(
        tmp_path: Path) -> None:
    """BrokenLog says "nothing was written": the file is the operator's evidence, left
    byte for byte, its torn tail included (the head is read before any cut)."""
    from custody.custodian.ledger import BrokenLog, SignLog

    path = tmp_path / "signed.jsonl"
    path.write_bytes(b'{"not": "a line of this log"}\n{"seq":2,"pr')
    before = path.read_bytes()
    with pytest.raises(BrokenLog):
        SignLog(path, 1 << 20)
    assert path.read_bytes() == before


def _owing(log: SignLog, line: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> SignLog:
    """`log`, owing `line`: its effect made, its write failed (the disk's sync)."""
    real = os.fdatasync

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError):
        log.append([line], done=True)
    monkeypatch.setattr(os, "fdatasync", real)
    return log


_RECOVERED = {"op": "recover", "agent": "b" * 64, "intent": 0}


@pytest.mark.token_independent
def test_close_writes_the_lines_still_owed(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A line owed (its effect made, its write failed) gets its last try at close: once
    the disk takes it again it is in the log, not only in the journal."""
    path = tmp_path / "signed.jsonl"
    log = _owing(SignLog(path, 1 << 20), _RECOVERED, monkeypatch)
    log.close()
    assert verify_chain(path) == 1
    assert json.loads(path.read_text())["op"] == "recover"


@pytest.mark.token_independent
def test_close_says_the_owed_lines_of_a_log_broken_meanwhile_and_raises_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """close runs in `finally` blocks (changes.py's commands): a log whose last line was
    made foreign meanwhile gives BrokenLog at the owed lines' last try, which close must
    not raise over the fault being raised; the lines go to the journal instead."""
    path = tmp_path / "signed.jsonl"
    log = _owing(SignLog(path, 1 << 20), _RECOVERED, monkeypatch)
    with open(path, "ab") as other:
        other.write(b"not a line of this log\n")
    with caplog.at_level("ERROR", logger="buzz_broker.custodian"):
        log.close()
    assert any("a line owed, never written" in r.getMessage() and "b" * 64 in r.getMessage()
               for r in caplog.records)


@pytest.mark.token_independent
async def test_a_line_whose_lock_is_free_is_written_even_when_the_row_is_being_cancelled(
        tmp_path: Path) -> None:
    """server.py `appended` makes its first try before any checkpoint: a change already
    made (a destroy, a signature) gets its line even when a cancellation (a SIGTERM's, a
    closed connection's) is pending at that moment, so no change is left unrecorded. Only
    a held lock makes it wait (and only then can a cancellation land)."""

    path = tmp_path / "signed.jsonl"
    log = SignLog(path, 1 << 20, wait=False)
    with trio.CancelScope() as scope:
        scope.cancel()  # pending: the next checkpoint would raise Cancelled
        seq = await appended(log, [{"op": "destroy", "agent": "b" * 64, "intent": 1}],
                             done=True)
        assert seq == 1
    log.close()
    assert verify_chain(path) == 1
    assert json.loads(path.read_bytes().splitlines()[0])["op"] == "destroy"


@pytest.mark.token_independent
def test_the_serving_logs_open_waits_for_a_writer_holding_the_lock(tmp_path: Path) -> None:
    """`SignLog(wait=False)` refuses to wait only at an append (server.py `appended` waits
    for it off the event loop); its open's look at the head waits, as nothing is served yet:
    a custodian started while `--recover` appends one line starts, it does not fail."""

    path = tmp_path / "signed.jsonl"
    first = SignLog(path, 1 << 20)
    first.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "1" * 64}])
    first.close()
    with open(path, "ab") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        threading.Timer(0.3, fcntl.flock, (other.fileno(), fcntl.LOCK_UN)).start()
        began = time.monotonic()
        log = SignLog(path, 1 << 20, wait=False)  # waits for the lock, then reads the head
        assert time.monotonic() - began >= 0.2
    assert log.seq == 1
    log.close()


@pytest.mark.token_independent
async def test_a_failed_write_is_answered_at_once_only_a_held_lock_is_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        autojump_clock: trio.testing.MockClock) -> None:
    """`appended` tries again only while another writer holds the lock (BlockingIOError):
    a write that fails (EIO, ENOSPC) raises at once, its `done` lines owed, so a full disk
    refuses each row at once instead of holding every row LOCK_WAIT_SECONDS."""

    path = tmp_path / "signed.jsonl"
    log = SignLog(path, 1 << 20, wait=False)

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "fdatasync", failing)
    began = trio.current_time()
    with pytest.raises(OSError) as raised:
        await appended(log, [{"op": "destroy", "agent": "b" * 64, "intent": 1}], done=True)
    assert raised.value.errno == errno.EIO
    assert trio.current_time() == began  # no retry, no wait
    monkeypatch.undo()
    await appended(log, [])  # the owed line, written once
    log.close()
    assert verify_chain(path) == 1


@contextlib.asynccontextmanager
async def _held_for_a_second(path: Path) -> AsyncIterator[None]:
    """Another writer's flock on the log at `path`, let go a second after the block starts:
    what the block does meanwhile waits for it, as a row beside a command's append does."""
    with open(path, "ab") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)

        async def let_go() -> None:
            await trio.sleep(1)
            fcntl.flock(other.fileno(), fcntl.LOCK_UN)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(let_go)
            yield


@pytest.mark.token_independent
async def test_owed_lines_wait_for_a_held_lock_before_a_row_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        autojump_clock: trio.testing.MockClock) -> None:
    """`_owed_first` writes the owed lines through `appended`: while a command beside the
    custodian holds the lock for an append, a row that would add a line waits (up to
    LOCK_WAIT_SECONDS) and is then served, the owed line written first, not refused."""

    path = tmp_path / "signed.jsonl"
    log = SignLog(path, 1 << 20, wait=False)

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError):
        log.append([{"op": "destroy", "agent": "b" * 64, "intent": 1}], done=True)
    monkeypatch.undo()  # owed now
    row = Custodian.__new__(Custodian)  # only its log and its line throttle are used
    row.log, row._lines = log, {}
    async with _held_for_a_second(path):
        await row._owed_first("sign")  # before: refused at once, CustodyError
    log.close()
    assert verify_chain(path) == 1
    assert json.loads(path.read_bytes().splitlines()[0])["op"] == "destroy"


@pytest.mark.token_independent
@pytest.mark.parametrize("fails", [False, True])
@pytest.mark.parametrize("held", [1, 6])
async def test_a_changes_intent_and_outcome_wait_for_a_held_lock_and_stay_owed_past_it(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, fails: bool,
        held: int) -> None:
    """`_change` writes its intent, its outcome and a `failed` line through `appended`: a
    lock held a moment by a command beside the custodian delays the change (its intent
    first) and its outcome line, neither refused at once; held past LOCK_WAIT_SECONDS
    (5 s), the outcome (a change made) stays owed and is written at the next append."""

    path = tmp_path / "signed.jsonl"
    log = SignLog(path, 1 << 20, wait=False)
    row = Custodian.__new__(Custodian)  # only its log is used
    row.log = log
    other = open(path, "ab")

    async def let_go(seconds: float) -> None:
        await trio.sleep(seconds)
        fcntl.flock(other.fileno(), fcntl.LOCK_UN)

    async with trio.open_nursery() as nursery:

        async def change() -> object:
            fcntl.flock(other.fileno(), fcntl.LOCK_EX)  # held when the outcome is due
            nursery.start_soon(let_go, held)
            if fails:
                raise RuntimeError("refused by the token")
            return "record"

        fcntl.flock(other.fileno(), fcntl.LOCK_EX)  # held when the intent is due
        nursery.start_soon(let_go, 1)
        raised = RuntimeError if fails else BlockingIOError if held > 5 else None
        if raised is not None:
            with pytest.raises(raised):
                await row._change({"for": "destroy", "agent": "b" * 64}, change,
                                  lambda record: {"op": "destroy"})
        else:
            await row._change({"for": "destroy", "agent": "b" * 64}, change,
                              lambda record: {"op": "destroy"})
    await appended(log, [])  # what is owed, once the lock is free
    other.close()
    log.close()
    assert verify_chain(path) == 2
    ops = [json.loads(x)["op"] for x in path.read_bytes().splitlines()]
    assert ops == ["intent", "failed" if fails else "destroy"]


@pytest.mark.token_independent
def test_a_row_gives_up_on_the_lock_before_the_pipelines_deadline() -> None:
    """A row answers `internal` after LOCK_WAIT_SECONDS, before the pipeline's own call
    deadline (client.py CALL_TIMEOUT) ends the call with no answer (server.py's comment)."""

    assert 0 < LOCK_POLL_SECONDS < LOCK_WAIT_SECONDS <= CALL_TIMEOUT / 2


@pytest.mark.token_independent
async def test_a_backup_written_while_the_lock_stays_held_keeps_its_line_owed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        autojump_clock: trio.testing.MockClock) -> None:
    """A backup file, once written, stands: its `backup` line is `done`, so a lock held
    past LOCK_WAIT_SECONDS leaves it owed (written at the next append), never dropped."""

    async def wrote(*args: object) -> object:
        return types.SimpleNamespace(path=tmp_path / "backup-1.age", sha256="5" * 64,
                                     agents=("a" * 64,))

    monkeypatch.setattr(server, "write_backup", wrote)
    path = tmp_path / "signed.jsonl"
    log = SignLog(path, 1 << 20, wait=False)
    row = Custodian.__new__(Custodian)  # its log, settings and backup lock are used
    row.log, row._backup_lock, row.custody = log, trio.Lock(), None
    row.settings = types.SimpleNamespace(backup_dir=tmp_path, backup_recipients=("age1x",),
                                         backup_bounds=None)
    with open(path, "ab") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        with pytest.raises(BlockingIOError):
            await row.backup({"names": []})
    await appended(log, [])
    log.close()
    assert [json.loads(x)["op"] for x in path.read_bytes().splitlines()] == ["backup"]


@pytest.mark.token_independent
@pytest.mark.parametrize("op", ["encrypt", "decrypt"])
async def test_an_encrypt_or_decrypt_waits_for_a_lock_held_a_moment(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, op: str) -> None:
    """Each row's line goes through `appended`: a lock a command beside the custodian holds
    for a moment delays the answer, it does not turn the row into `internal` at once."""

    async def two(agent: str, texts: list[object]) -> list[object]:
        return [b"x" for _ in texts]

    path = tmp_path / "signed.jsonl"
    log = SignLog(path, 1 << 20, wait=False)
    row = Custodian.__new__(Custodian)  # its log, and custody's two calls stubbed
    row.log = log
    row.custody = types.SimpleNamespace(encrypt_to_owner=two, decrypt_from_owner_pair=two)
    row._pair = lambda agent, peer: None
    args = {"agent": "a" * 64, "peer": "b" * 64, "plaintexts": ["p"], "payloads": ["q"]}
    async with _held_for_a_second(path):
        await getattr(row, op)(args)
    log.close()
    assert [json.loads(x)["op"] for x in path.read_bytes().splitlines()] == [op]
