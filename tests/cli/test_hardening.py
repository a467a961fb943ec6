"""A `buzz-broker` command is hardened before it reads a secret, not only once custody opens.

The README's promise: every `buzz-broker` process writes no core dump and cannot be traced
by other processes of the same user. `main` runs `harden_process` first
(daemon/cli/__init__.py); `Custody.open` does it again, but `agent import` opens custody
only after it has read the agent's secret from stdin, so while it waits for that secret,
and while the secret sits in its memory, only `main`'s call protects it. (The daemon with
a custodian, which never opens custody, is
tests/custodian/test_two_uids.py::test_the_pipeline_is_hardened_in_either_layout's; the
mechanism itself, on a bare process, tests/custody/test_process_hardening.py's.)

Real parts: `python -m daemon.cli` as an operator runs it, its stdin a terminal (a pty), so
it prompts on stderr just before the read: the check runs while the command waits there.
It is started with core dumps allowed (RLIMIT_CORE raised as far as this process may, as
`ulimit -c unlimited` does), so a limit of 0 is the command's own doing. A test that opened
custody in this pytest process hardened the process itself, and its hard limit of 0 cannot
be raised again without CAP_SYS_RESOURCE: then the control below shows the limit the
command was given was already 0, and the undumpable check is the one that tells (it does
not depend on the limit: exec makes every new program dumpable again).

How "cannot be traced by the same user" is read from outside: an undumpable process's
/proc/<pid> entries pass to root (the kernel's task_dump_owner), so a peer of its uid
cannot read its environ or memory. That needs the command to run as a uid other than
root: under root the test runs it (and the peer) as nobody, as
tests/custody/test_process_hardening.py does; under another uid, as that uid.
"""

from __future__ import annotations

import os
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.custody._secrets import PUB_2
from tests.fixtures.stop import terminate_then_kill

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
#: What `agent import` prints on a terminal right before it reads (daemon/cli/agent.py).
PROMPT = b"agent secret (64 hex or nsec1"
#: The command is up in well under a second here; this only catches a hung start.
PROMPT_SECONDS = 30.0

#: Reads another process's /proc entries as a peer of its uid would (only whether it can).
_PEER = """
import sys
for name in ("environ", "mem"):
    try:
        with open(f"/proc/{sys.argv[1]}/{name}", "rb"):
            print(name, "read")
    except PermissionError:
        print(name, "denied")
"""

#: A process that does not harden itself: says it is up, then waits for stdin to close.
_PLAIN = "import sys\nprint('up', flush=True)\nsys.stdin.read()\n"

pytestmark = [
    pytest.mark.token_independent,  # no token: the check runs before the secret is read
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="reads /proc/<pid>; PR_SET_DUMPABLE is Linux-only"),
]


def _as_peer() -> list[str]:
    """The prefix that runs a command as a uid other than root (nobody, under root)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) not installed: cannot run the command as nobody")
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


def _allow_core_dumps() -> None:
    """Core dumps as large as they may be: unlimited where CAP_SYS_RESOURCE allows it, else
    the soft limit raised to the hard one."""
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY,) * 2)
    except (OSError, ValueError):
        hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


@pytest.fixture
def home() -> Iterator[Path]:
    """A directory the command's uid owns (tmp_path is root's alone under root)."""
    base = Path(tempfile.mkdtemp(prefix="bb-harden-", dir="/tmp"))
    base.chmod(0o711)
    own = base / "home"
    own.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(own, NOBODY, NOBODY)
    try:
        yield own
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _seen(pid: int, prefix: list[str]) -> tuple[list[str], int, list[str]]:
    """What the outside sees of process `pid`: its core limit (soft, hard), the owner of
    its /proc entries, and what a peer of its uid could open there."""
    limits = Path(f"/proc/{pid}/limits").read_text()
    [core] = [line.split()[4:6] for line in limits.splitlines()
              if line.startswith("Max core file size")]
    owner = Path(f"/proc/{pid}/environ").stat().st_uid
    peer = subprocess.run([*prefix, sys.executable, "-c", _PEER, str(pid)], cwd="/",
                          capture_output=True, text=True, timeout=30, check=True)
    return core, owner, peer.stdout.split()


def _until_prompt(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stderr is not None
    seen, deadline = b"", time.monotonic() + PROMPT_SECONDS
    while PROMPT not in seen:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, (proc.returncode, seen.decode(errors="replace"))
        ready, _, _ = select.select([proc.stderr], [], [], left)
        if ready:
            seen += os.read(proc.stderr.fileno(), 4096)


def test_agent_import_waiting_for_its_secret_writes_no_core_and_is_closed_to_its_uid(
    home: Path,
) -> None:
    prefix = _as_peer()
    uid = os.geteuid() if not prefix else NOBODY
    config = home / "broker.toml"
    config.write_text(f'[state]\ndir = "{home / "state"}"\n[relay]\nurl = "ws://127.0.0.1:1"\n')
    if prefix:
        os.chown(config, NOBODY, NOBODY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUZZ_BROKER_")}

    # The control, started the same way: a process of that uid that does not harden
    # itself keeps the core limit it was given (["0", "0"] only where this pytest process
    # was hardened and may not raise it: see the module docstring) and is open to its peer.
    plain = subprocess.Popen([*prefix, sys.executable, "-c", _PLAIN], cwd="/", env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             preexec_fn=_allow_core_dumps)
    try:
        assert plain.stdout is not None and plain.stdout.readline() == b"up\n"
        given, owner, peer = _seen(plain.pid, prefix)
        assert (owner, peer[:2]) == (uid, ["environ", "read"])
        if resource.getrlimit(resource.RLIMIT_CORE)[1] != 0:
            assert given != ["0", "0"]  # so a 0 below is the command's own doing
    finally:
        terminate_then_kill(plain, 15)

    master, terminal = os.openpty()
    try:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "daemon.cli", "--config", str(config),
             "agent", "import", "--owner", PUB_2],
            cwd=REPO, env=env, stdin=terminal, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, preexec_fn=_allow_core_dumps, start_new_session=True)
    finally:
        os.close(terminal)
    try:
        _until_prompt(proc)  # it now waits in the read that takes the secret
        # No core file; undumpable: its /proc entries passed to root, its uid is shut out.
        assert _seen(proc.pid, prefix) == (["0", "0"], 0, ["environ", "denied", "mem", "denied"])
    finally:
        terminate_then_kill(proc, 15)
        os.close(master)
        if proc.stderr is not None:
            proc.stderr.close()
