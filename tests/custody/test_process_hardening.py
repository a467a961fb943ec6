"""A process that opened custody writes no core and cannot be read by same-uid peers.

Security finding 3 (the review's finding 5): nothing outside the systemd unit turned core
dumps off. `harden_process` (run by `Custody.open` and `init_kek`) sets RLIMIT_CORE to 0
and PR_SET_DUMPABLE to 0. These tests pin what that does and what it leaves readable:
benchmarks read /proc/<pid>/stat and /status of the daemon, which must keep working.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from custody import TokenConfig
from tests.fixtures.token import REPO

PYTHON = str(REPO / ".venv" / "bin" / "python")
NOBODY = 65534

#: A Python another uid may run: the venv's interpreter lives under root's home.
SYSTEM_PYTHON = "/usr/bin/python3"
PROCESS_MODULE = str(REPO / "custody" / "_process.py")

#: Loads custody/_process.py on its own (the rest of custody needs the venv), hardens itself
#: unless told not to, says whether it is dumpable, then waits for stdin to close.
_HARDENED_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("custody_process", sys.argv[1])
process = importlib.util.module_from_spec(spec); spec.loader.exec_module(process)
if sys.argv[2] == "harden":
    process.harden_process()
print(process.is_dumpable(), flush=True)
sys.stdin.read()
"""

#: Reads another process's /proc entries the way benchmarks/_harness.proc_stat does, and
#: the ones PR_SET_DUMPABLE closes.
_READER = """
import sys
pid = sys.argv[1]
for name in ("stat", "status", "environ", "maps"):
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            print(name, "read" if fh.read() else "empty")
    except PermissionError:
        print(name, "denied")
"""


def _as_nobody() -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _read_proc(pid: int, *, as_nobody: bool) -> dict[str, str]:
    done = subprocess.run(
        [SYSTEM_PYTHON, "-c", _READER, str(pid)], cwd="/", capture_output=True, text=True,
        timeout=30, check=True, preexec_fn=_as_nobody if as_nobody else None,
    )
    return dict(line.split() for line in done.stdout.splitlines())


@pytest.mark.token_independent
@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0
                    or not os.path.exists(SYSTEM_PYTHON),
                    reason="needs Linux /proc, root (to run processes as another uid) and "
                    "a system Python")
@pytest.mark.parametrize("hardened", [False, True])
def test_same_uid_peers_lose_proc_access_and_stat_stays_readable(hardened: bool) -> None:
    child = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", _HARDENED_CHILD, PROCESS_MODULE, "harden" if hardened else "no"],
        cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, preexec_fn=_as_nobody,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == str(not hardened)
        seen = _read_proc(child.pid, as_nobody=True)  # a peer with the same uid
        closed = "denied" if hardened else "read"
        assert seen == {"stat": "read", "status": "read", "environ": closed, "maps": closed}
        # Root (the test runner, the benchmarks here) still reads everything.
        assert _read_proc(child.pid, as_nobody=False)["environ"] == "read"
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_keys_init_hardens_too(custody_state: tuple[TokenConfig, Path]) -> None:
    config, _ = custody_state
    probe = (
        "import resource, sys, trio\n"
        "from custody import TokenConfig, init_kek\n"
        "from custody._process import is_dumpable\n"
        "cfg = TokenConfig(module=sys.argv[1], token_label=sys.argv[2], pin_file=sys.argv[3],"
        " kek_label=sys.argv[4])\n"
        "trio.run(init_kek, cfg)\n"
        "print(is_dumpable(), resource.getrlimit(resource.RLIMIT_CORE))\n"
    )
    done = subprocess.run(
        [PYTHON, "-c", probe, config.module, config.token_label, str(config.pin_file),
         config.kek_label], cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stdout.split(maxsplit=1) == ["False", "(0, 0)\n"]
