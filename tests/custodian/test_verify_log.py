"""`buzz-broker custodian FILE --verify-log` (custody/custodian/verify.py): the custodian's
signed log checked by the operator, as docs/custodian.md ("The signed log") says.

On a real custodian (real token, its own process), asked as the pipeline would:
- a log it wrote verifies, beside it serving: one line, exit 0, the lines counted and the
  head its last line's;
- a line edited is one line naming the file and the line, exit 3;
- a log moved past `log_max_bytes` verifies across the move (`signed.jsonl.1`, then
  `signed.jsonl`, one chain), and a line cut where the files meet breaks it;
- verifying while it signs and moves its log, and while a writer holds the log's lock,
  never waits and never reports a break that is not there;
- no log directory is one line, exit 1.
And the rules on their own, on logs written by `SignLog` (no token): the first line's
`prev` (GENESIS for seq 1, else as given), `seq` one more each line, a partial last line
of the current file not read, of the older file a break.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from custody import TokenConfig
from custody.custodian.client import CustodianClient
from custody.custodian.ledger import GENESIS, SignLog, hashed_line
from custody.custodian.verify import EXIT_BROKEN, BrokenAt, check_log
from tests.custodian.test_refusals import ask, held, human, intent
from tests.fixtures.custodian import CustodianProcess, running_custodian, write_custodian_config

REPO = Path(__file__).resolve().parents[2]
LOG_MAX_BYTES = 4096
ENTRY_POINTS = {"buzz-broker custodian": ["daemon.cli", "custodian"],
                "python -m custody.custodian": ["custody.custodian"]}


def verify(config: Path, entry: str = "buzz-broker custodian") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
    return subprocess.run([sys.executable, "-m", *ENTRY_POINTS[entry], str(config),
                           "--verify-log"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


def _ok(done: subprocess.CompletedProcess[str], log: Path, files: str) -> str:
    """The ok line, held to the log as it is on disk (the custodian idle)."""
    assert done.returncode == 0 and done.stderr == "", (done.returncode, done.stderr)
    lines = [json.loads(line) for name in ("signed.jsonl.1", "signed.jsonl")
             if (log / name).exists() for line in (log / name).read_text().splitlines()]
    assert done.stdout == (f"custodian: signed log ok: {len(lines)} lines checked in {files} "
                           f"({log}); head {lines[-1]['seq']}:{lines[-1]['hash']}\n"), done.stdout
    return done.stdout


def _broken(done: subprocess.CompletedProcess[str], path: Path, line: int) -> str:
    assert done.returncode == EXIT_BROKEN == 3, (done.returncode, done.stderr)
    assert done.stdout.count("\n") == 1 and done.stderr == "", (done.stdout, done.stderr)
    assert done.stdout.startswith(f"custodian: signed log broken: {path} line {line}: ")
    return done.stdout


@pytest.fixture
def moving(custody_state: tuple[TokenConfig, Path], local_relay: str,
           tmp_path: Path) -> Iterator[CustodianProcess]:
    """A custodian whose log moves past 4 KiB, its log in `tmp_path/log`."""
    with running_custodian(custody_state, local_relay, tmp_path,
                           settings={"log_dir": str(tmp_path / "log"),
                                     "log_max_bytes": LOG_MAX_BYTES}) as process:
        yield process


def _sign(socket: Path, agent: str, n: int = 1) -> None:
    ok, events = ask(socket, "sign", events=[intent(agent, 9, [["h", "chan"]], f"m {i}")
                                             for i in range(n)])
    assert ok and isinstance(events, list) and len(events) == n, events


async def test_a_log_it_wrote_verifies_beside_it_and_an_edit_names_its_line(
        custodian: CustodianProcess) -> None:
    client = await CustodianClient.open(custodian.socket)
    agent = await held(client, human())
    minted = (await client.mint_agent(owner=agent)).pubkey
    await client.destroy_agent(minted)
    await client.aclose()
    _sign(custodian.socket, agent, 3)
    log = custodian.config.parent / "state" / "custodian"
    for entry in ENTRY_POINTS:  # beside the serving custodian: it answers on
        _ok(verify(custodian.config, entry), log, "signed.jsonl")
    _sign(custodian.socket, agent)
    _ok(verify(custodian.config), log, "signed.jsonl")
    custodian.stop()
    # One byte of one line changed (the kind signed, in the sign line's own entry).
    path = log / "signed.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if json.loads(line)["op"] == "sign")
    entry = json.loads(lines[at])
    lines[at] = lines[at].replace(f'"kind":{entry["kind"]}', '"kind":1')
    path.write_text("".join(lines))
    broken = _broken(verify(custodian.config), path, at + 1)
    assert "the line was edited" in broken and f"({at} lines checked before it)" in broken


async def test_a_moved_log_verifies_across_the_move_and_its_seam_is_checked(
        moving: CustodianProcess, tmp_path: Path) -> None:
    client = await CustodianClient.open(moving.socket)
    agent = await held(client, human())
    await client.aclose()
    log = tmp_path / "log"
    older, current = log / "signed.jsonl.1", log / "signed.jsonl"

    def first_seq() -> int:
        return int(json.loads(older.read_text().splitlines()[0])["seq"]) if older.exists() else 0

    while first_seq() <= 1:  # moved twice: the first older file is gone, its lines unchecked
        _sign(moving.socket, agent)
    _sign(moving.socket, agent, 2)  # the current file holds lines too
    _ok(verify(moving.config), log, "signed.jsonl.1 and signed.jsonl")
    moving.stop()
    # The older file's last line cut: the current file's first line no longer chains.
    kept = older.read_text().splitlines(keepends=True)
    older.write_text("".join(kept[:-1]))
    broken = _broken(verify(moving.config), current, 1)
    assert "its prev is not the hash of the line before it" in broken
    assert f"({len(kept) - 1} lines checked before it)" in broken
    # The older file itself cut inside its last line: a break there, not a line in flight.
    older.write_text("".join(kept)[:-10])
    _broken(verify(moving.config), older, len(kept))


async def test_verifying_while_it_signs_and_moves_waits_for_nothing_and_finds_no_break(
        moving: CustodianProcess, tmp_path: Path) -> None:
    """No lock is taken: a writer holding the log's lock (a command beside the custodian)
    does not hold the verify, nor the verify the custodian; and lines being written, and
    moves to `.1` between the two files' opens, are never read as a break."""
    client = await CustodianClient.open(moving.socket)
    agent = await held(client, human())
    await client.aclose()
    log = tmp_path / "log"
    stop = threading.Event()
    signed = [0]

    def sign() -> None:
        while not stop.is_set():
            _sign(moving.socket, agent, 4)
            signed[0] += 1

    signer = threading.Thread(target=sign)
    signer.start()
    try:
        outcomes = [verify(moving.config) for _ in range(8)]
    finally:
        stop.set()
        signer.join(timeout=30)
    assert all(done.returncode == 0 and done.stdout.startswith("custodian: signed log ok: ")
               for done in outcomes), [(d.returncode, d.stdout, d.stderr) for d in outcomes]
    assert signed[0] > 8 and (log / "signed.jsonl.1").exists()  # it signed, and moved, meanwhile
    _sign(moving.socket, agent)  # a move may have left no current file: one line makes it
    with open(log / "signed.jsonl", "rb") as held_open:  # a writer holding the lock
        fcntl.flock(held_open.fileno(), fcntl.LOCK_EX)
        done = verify(moving.config)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.token_independent
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_no_log_directory_is_one_line(tmp_path: Path, entry: str) -> None:
    config = write_custodian_config(
        tmp_path / "custodian.toml",
        token=TokenConfig(module="/nonexistent.so", token_label="t", pin_file=None),
        state_dir=tmp_path / "state", socket=tmp_path / "s", relay_url="ws://127.0.0.1:1")
    done = verify(config, entry)
    assert done.returncode == 1 and done.stdout == "", (done.returncode, done.stdout)
    assert done.stderr == (f"custodian: {tmp_path / 'state' / 'custodian'} (log_dir in "
                           f"{config}): no such directory; no signed log to verify\n")
    assert not (tmp_path / "state").exists()  # it reads only: nothing made
    (tmp_path / "state" / "custodian").mkdir(parents=True)  # a directory with no log in it
    done = verify(config, entry)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "neither it nor signed.jsonl.1 is there" in done.stderr


def _lines(seqs: list[int], prev: str = GENESIS) -> str:
    """Lines as SignLog writes them (ledger.py `hashed_line`, `hash` last), numbered `seqs`,
    the first chained to `prev`: each whole, whatever its numbering."""
    out = []
    for seq in seqs:
        body, prev = hashed_line(prev, {"seq": seq, "prev": prev, "at": 1_700_000_000,
                                    "op": "sign", "agent": "a" * 64, "kind": 9})
        out.append(f'{body[:-1]},"hash":"{prev}"}}\n')
    return "".join(out)


def _break(path: Path) -> tuple[Path, int, str]:
    with pytest.raises(BrokenAt) as broken:
        check_log(path)
    return broken.value.path, broken.value.broken.line, broken.value.broken.why


@pytest.mark.token_independent
def test_the_first_line_chains_to_genesis_or_is_taken_as_given(tmp_path: Path) -> None:
    path = tmp_path / "signed.jsonl"
    path.write_text(_lines([1, 2, 3]))
    assert (check_log(path).lines, check_log(path).seq) == (3, 3)
    path.write_text(_lines([7, 8], prev="ab" * 32))  # what a dropped older file leaves
    checked = check_log(path)
    assert (checked.lines, checked.seq, checked.files) == (2, 8, (path,))
    path.write_text(_lines([1, 2], prev="ab" * 32))  # seq 1 chained to something: not its
    assert _break(path)[1:] == (1, "its prev is not the hash of the line before it (a line "
                                   "cut, added or moved)")
    # A SignLog's own log verifies, and its head is its last line's.
    real = tmp_path / "real" / "signed.jsonl"
    log = SignLog(real, 1 << 20)
    log.append([{"op": "sign", "agent": "b" * 64, "kind": 9, "id": "c" * 64}] * 3)
    log.close()
    last = json.loads(real.read_text().splitlines()[-1])
    assert (check_log(real).seq, check_log(real).head) == (3, last["hash"])


@pytest.mark.token_independent
def test_seq_is_one_more_each_line_and_a_partial_tail_is_only_the_current_files(
        tmp_path: Path) -> None:
    path = tmp_path / "signed.jsonl"
    path.write_text(_lines([1, 2, 4]))  # every line whole and chained, one seq skipped
    assert _break(path)[1:] == (3, "its seq 4 does not follow 2")
    lines = _lines([1, 2, 3])
    path.write_text(lines + lines[:20])  # a line being written: not read
    checked = check_log(path)
    assert (checked.lines, checked.partial) == (3, True)
    older = tmp_path / "signed.jsonl.1"
    os.replace(path, older)  # moved, its partial tail with it: no writer writes there now
    assert _break(path)[:2] == (older, 4)
    # The older file, then the current one: one chain across them, `seq` too.
    older.write_text(_lines([5, 6], prev="cd" * 32))
    head = json.loads(older.read_text().splitlines()[-1])["hash"]
    path.write_text(_lines([7, 8], prev=head))
    assert (check_log(path).lines, check_log(path).files) == (4, (older, path))
    path.write_text(_lines([8, 9], prev=head))
    assert _break(path) == (path, 1, "its seq 8 does not follow 6")


@pytest.mark.token_independent
def test_a_move_between_the_two_opens_is_read_again_not_called_a_break(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The verify opens `signed.jsonl`, then `signed.jsonl.1`: a writer's move between the
    two (SignLog's, with a line after it) would pair the moved file with itself. The look
    at `signed.jsonl` after both opens sees it and opens the pair again."""
    from custody.custodian import verify as module

    path, older = tmp_path / "signed.jsonl", tmp_path / "signed.jsonl.1"
    log = SignLog(path, 4096)
    while not older.exists():
        log.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "b" * 64}])
    log.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "c" * 64}])
    opened = module._open
    moves = [0]

    def open_then_move(name: Path) -> object:
        file = opened(name)
        if name == path and moves[0] < 2:  # twice: the pair is read on the third try
            moves[0] += 1
            while path.exists():  # a writer's lines, until its move
                log.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "d" * 64}])
            log.append([{"op": "sign", "agent": "a" * 64, "kind": 9, "id": "e" * 64}])
        return file

    monkeypatch.setattr(module, "_open", open_then_move)
    checked = check_log(path)
    log.close()
    assert moves[0] == 2 and checked.files == (older, path)
    lines = older.read_text().splitlines() + path.read_text().splitlines()
    assert (checked.lines, checked.head) == (len(lines), json.loads(lines[-1])["hash"])


@pytest.mark.token_independent
@pytest.mark.parametrize("name", ["signed.jsonl", "signed.jsonl.1"])
@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_link_or_fifo_in_the_log_directory_is_refused_unread(
        tmp_path: Path, name: str, planted: str) -> None:
    """Root may verify a log in a directory the custodian's user owns: a link planted
    there must not make root read another file (its verdict would tell something of it),
    nor a FIFO hang the command. Either is one line, exit 1, with nothing read."""
    config = write_custodian_config(
        tmp_path / "custodian.toml",
        token=TokenConfig(module="/nonexistent.so", token_label="t", pin_file=None),
        state_dir=tmp_path / "state", socket=tmp_path / "s", relay_url="ws://127.0.0.1:1")
    log = tmp_path / "state" / "custodian"
    log.mkdir(parents=True)
    other = tmp_path / "root-only"
    other.write_text(_lines([1, 2]))  # a log's lines: followed, it would verify "ok"
    if name == "signed.jsonl.1":
        (log / "signed.jsonl").write_text(_lines([3], prev="0" * 64))
    if planted == "symlink":
        (log / name).symlink_to(other)
    else:
        os.mkfifo(log / name)
    done = verify(config)
    assert done.returncode == 1 and done.stdout == "", (done.returncode, done.stdout)
    assert done.stderr.count("\n") == 1 and str(log / name) in done.stderr, done.stderr
