"""The daemon's credential store follows the CLI's changes after its own writes, and the
file stays whole (found by review, reproduced with real processes).

SQLite's locks are POSIX locks, per process, and closing any descriptor of the database
drops all of them. The store's second writer (the 60 s last-use flush, `revoke_agent`)
opened and closed the file by a raw descriptor before connecting, which left the daemon's
long-lived connection without its read lock. The next CLI process to close the database
then thought itself the last user, checkpointed and deleted the WAL, and from there the
daemon read a stale index: a revoked credential kept working (SIGHUP's reload too), a new
one was refused, and the daemon's close wrote an old image over the file (revocation
undone, new credentials gone, indexes broken).

Here this test process holds the store as the daemon does; each CLI step runs in a fresh
process, as `buzz-broker credential` does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from daemon.state.sessions import Principal, SessionStore

REPO = Path(__file__).resolve().parents[2]
AGENT = "ab" * 32
CHANNEL = "b39f951a-c094-4708-80a4-f6f04d0c5fc5"
ISSUE = ("cid, tok = s.issue(agent={agent!r}, channels=frozenset({{{channel!r}}}), "
         "actions=frozenset({{'channel.read'}}), ttl_seconds=None, uid=None, "
         "now=int(time.time())); print(json.dumps([cid, tok]))")


def _cli(state: Path, code: str) -> str:
    """One operator step in its own process: open the store, run `code`, close it."""
    program = ("import json, time\nfrom daemon.state.sessions import SessionStore\n"
               f"s = SessionStore.open({str(state)!r})\n{code}\ns.close()\n")
    return subprocess.run([sys.executable, "-c", program], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()


def _issue(state: Path) -> tuple[str, str]:
    cid, token = json.loads(_cli(state, ISSUE.format(agent=AGENT, channel=CHANNEL)))
    return cid, token


def test_the_daemons_store_sees_cli_changes_after_its_own_writes(tmp_path: Path) -> None:
    daemon = SessionStore.open(tmp_path)
    try:
        def accepts(token: str) -> bool:
            return isinstance(daemon.check("Bearer " + token, None, int(time.time())), Principal)

        a_id, a_token = _issue(tmp_path)
        assert accepts(a_token)
        daemon.write_last_use(daemon.take_last_use())  # the daemon's own second writer
        daemon.revoke_agent("cd" * 32)  # its other one (an agent with no credential)
        b_id, b_token = _issue(tmp_path)
        assert accepts(b_token)
        _cli(tmp_path, f"print(s.revoke({a_id!r}))")
        assert not accepts(a_token)  # the next request after a revocation
        assert (tmp_path / "sessions.db-wal").exists()  # the daemon's connection holds it
        c_id, c_token = _issue(tmp_path)
        assert accepts(c_token)
    finally:
        daemon.close()
    listed = json.loads(_cli(tmp_path, "print(json.dumps([[i.credential_id, "
                                       "i.revoked_at is not None] for i in s.list()]))"))
    assert sorted(map(tuple, listed)) == sorted([(a_id, True), (b_id, False), (c_id, False)])
    integrity = _cli(tmp_path, "print(s._conn.execute('PRAGMA integrity_check').fetchone()[0])")
    assert integrity == "ok"
