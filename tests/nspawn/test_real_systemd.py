"""docs/install.md on real systemd: a Debian 12 container with systemd as PID 1 (issue 14).

What it proves, as an agent user in `buzz-agents`, a second agent user and an outsider:
the doc's marked blocks run as written; step 3's token block run again changes nothing;
the agent's first request starts the service (socket activation); Type=notify readiness,
and a start that fails before READY=1 fails the job; `systemctl reload` keeps the PID;
restart; SIGKILL and Restart=on-failure; the watchdog restarts a stopped event loop; a
uid-bound credential is refused for another uid; the outsider cannot reach the socket; the
metrics scrape; `systemd-analyze security` <= 1.5; `journalctl -p warning` finds the
daemon's warnings (the `<N>` prefix); `status` on a running and a stopped daemon; the
custodian (both units, two uids, the token and the KEK made under the custodian's uid from
the start: the first request activates both, the daemon has no PIN, no token access,
cannot open the keystore, maps no module, lists the custodian's agents; a SIGKILLed
custodian is restarted by systemd; `--recover` and `--forget-destroyed` as root through
buzz-custodian-admin beside it); a host installed with custody in the daemon moving its
keys to the custodian by step 6b's block; upgrade and uninstall.

Rules:
- The doc is the script: `install_blocks()` takes every fenced block that follows an
  ``<!-- install-test step=NAME [as=agent|outsider] [file=PATH] -->`` marker, in order,
  and the test runs exactly those (after replacing the placeholders in `PLACEHOLDERS`).
  `test_install_doc_is_marked` fails if a step the test relies on is missing.
- What only the test adds is `TEST_ONLY`, nothing else; systemd/README.md lists it too.
- It skips only when this machine cannot boot a container (guest.cannot_boot), and then
  says so loudly (a warning, the skip reason, and a banner on stderr). Any other fault
  (the image cannot be built, the guest does not boot) is a failure.
- The base image and a pip wheel cache live outside the checkout (tests/nspawn/guest.py:
  CACHE); a run after the first needs no network.
- Not provable here: the guest's PID 1 lacks CAP_SYS_RESOURCE, so LimitMEMLOCK=infinity is
  not granted (the limit stays finite) and the daemon logs serve.mlock_skipped (which the
  journald check uses).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures.relay import TestKey, free_port, start_devrelay
from tests.nspawn import guest as guest_mod
from tests.nspawn.guest import Guest, GuestError

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
INSTALL_MD = REPO / "docs" / "install.md"

AGENT = "scout"
SECOND_AGENT = "scout2"
OUTSIDER = "outsider"
USERS = {"agent": AGENT, "second": SECOND_AGENT, "outsider": OUTSIDER}
#: The doc's metrics address; the guest shares the host's network, so the test moves it.
DOC_METRICS = "127.0.0.1:9464"
#: The doc's (and buzz-broker-tcp.socket's) loopback TCP address; moved for the same reason.
DOC_TCP = "127.0.0.1:7475"
GUEST_WHEELS = "/var/cache/buzz-broker-wheels"

#: Everything the test does that docs/install.md does not say (systemd/README.md repeats it).
TEST_ONLY = {
    "checkout": "the checkout under test is copied to /opt/buzz-broker/src (the doc's git clone)",
    "pip": f"pip installs offline from a wheel cache bind-mounted at {GUEST_WHEELS} "
           "(PIP_NO_INDEX, PIP_FIND_LINKS); built on the host from pyproject.toml",
    "users": f"Unix users {AGENT} and {SECOND_AGENT} (agents, in buzz-agents) and {OUTSIDER} (not)",
    "placeholders": "<agent-user>, <owner-pubkey-hex> (a throwaway key), <channel-uuid>, "
                    "<relay-url> (nostr-sdk's LocalRelay on the host's loopback), and the "
                    f"metrics port instead of {DOC_METRICS.split(':')[1]} (shared network)",
    "tcp-port": f"the guest's copy of buzz-broker-tcp.socket and the doc's {DOC_TCP} get a "
                "free port instead (shared network)",
    "metrics-port": "the guest's copy of buzz-broker-metrics.socket gets the doc's moved "
                    f"metrics port instead of {DOC_METRICS.split(':')[1]} (shared network)",
    "reboot": "buzz-custodian.service stopped before step 7, its socket kept (as after a "
              "reboot: step 6's commands started it), so the first request activates both",
    "watchdog": "a drop-in buzz-broker.service.d/test-watchdog.conf with WatchdogSec=3s",
    "token-again": "step 3's token block run a second time once the SO PIN's block has "
                   "removed both PIN files, as an operator unsure it ran would (it must "
                   "change nothing)",
    "old-layout": "for step 6b's move: the custodian's units, drop-in, configuration and "
                  "state removed and the daemon's state emptied, then the install before the "
                  "custodian (the token made as buzz-broker under /var/lib/buzz-broker, "
                  "[pkcs11] instead of [custody], keys init and the agent as the daemon's "
                  "user), and after the move the custodian stopped as after a reboot",
    "spare-agent": "an agent `spare` (a throwaway owner) created, removed, recovered, removed "
                   "again and forgotten by name, for step 5's --recover and --forget-destroyed",
    "faults": "a drop-in pointing BUZZ_BROKER_CONFIG at a config whose custodian socket is "
              "missing (failed start), SIGKILL, SIGSTOP/SIGCONT (watchdog), the scout credential copied "
              "to scout2 (uid binding), and a SIGKILL of the custodian",
}


# --------------------------------------------------------------------------- the doc


@dataclass(frozen=True)
class Block:
    step: str
    user: str  # "root", "agent", "outsider"
    file: str | None
    text: str


_MARKER = re.compile(r"<!-- install-test ([^>]*?)-->\s*\n```[a-z]*\n(.*?)\n```", re.S)


def install_blocks(text: str | None = None) -> list[Block]:
    """The marked blocks of docs/install.md, in order."""
    text = INSTALL_MD.read_text() if text is None else text
    blocks = []
    for match in _MARKER.finditer(text):
        attrs = dict(part.split("=", 1) for part in match.group(1).split())
        blocks.append(Block(attrs["step"], attrs.get("as", "root"), attrs.get("file"),
                            match.group(2)))
    return blocks


#: The steps this test drives, in the doc's order.
STEPS = ("packages", "program", "units", "agent-group", "custodian", "token", "so-pin",
         "custodian-config", "config", "check-config", "keys", "agent", "move-custody", "start",
         "first-request", "check", "metrics", "tcp", "upgrade", "uninstall")


def test_install_doc_is_marked() -> None:
    """Every step the real-systemd test runs is a marked block of docs/install.md."""
    steps = [b.step for b in install_blocks()]
    assert steps == list(STEPS)


# --------------------------------------------------------------------------- the guest


def _loud_skip(reason: str) -> None:
    banner = f"\n{'!' * 78}\n!! REAL-SYSTEMD TEST NOT RUN: {reason}\n{'!' * 78}\n"
    if sys.__stderr__ is not None:  # past pytest's capture: on the terminal, in CI's log
        sys.__stderr__.write(banner)
    warnings.warn(f"real-systemd test not run: {reason}", stacklevel=2)
    pytest.skip(f"REAL-SYSTEMD TEST NOT RUN: this machine cannot boot a container: {reason}")


def _wheel_cache() -> Path:
    """Wheels for the project's dependencies, built on the host once per pyproject.toml."""
    key = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:12]
    wheels = guest_mod.CACHE / f"wheels-{key}"
    with guest_mod._locked("wheels"):
        if (wheels / ".complete").exists():
            return wheels
        scratch = guest_mod.CACHE / f".wheels-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(scratch),
             str(REPO), "setuptools>=68", "wheel"],
            capture_output=True, text=True, timeout=900,
        )
        if done.returncode != 0:
            raise RuntimeError("pip wheel failed: " + done.stderr[-2000:])
        for own in scratch.glob("buzz_broker-*.whl"):
            own.unlink()  # the guest builds the project itself, as the doc says
        (scratch / ".complete").touch()
        shutil.rmtree(wheels, ignore_errors=True)
        scratch.rename(wheels)
        return wheels


def _copy_checkout(root: Path) -> None:
    dest = root / "opt" / "buzz-broker" / "src"
    skip = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build", "run",
                                  ".mypy_cache", ".pytest_cache")
    shutil.copytree(REPO, dest, ignore=skip, symlinks=True)


@dataclass
class Installed:
    guest: Guest
    placeholders: dict[str, str]
    metrics_port: int
    facts: dict[str, str]
    env: dict[str, str]

    def block(self, block: Block, *, check: bool = True) -> guest_mod.Done | None:
        text = block.text
        for name, value in self.placeholders.items():
            text = text.replace(name, value)
        if block.file is not None:
            (self.guest.root / block.file.lstrip("/")).write_text(text + "\n")
            return None
        user = None if block.user == "root" else USERS[block.user]
        return self.sh(text, user=user, what=f"docs/install.md step {block.step}", check=check)

    def sh(self, script: str, *, user: str | None = None, what: str = "",
           check: bool = True) -> guest_mod.Done:
        env = dict(self.env)
        if user is not None:
            env["HOME"] = f"/home/{user}"
        done = self.guest.run(["bash", "-euo", "pipefail", "-c", script], user=user, env=env,
                              check=False, timeout=300)
        if check and done.returncode != 0:
            raise GuestError(f"{what or script[:60]!r} failed\n{done.text()}")
        return done

    def show(self, prop: str, unit: str = "buzz-broker.service") -> str:
        return self.sh(f"systemctl show -p {prop} --value {unit}").stdout.strip()

    def call(self, user: str, credential: str = "~/.config/buzz-broker/credential",
             content: str = "ping") -> guest_mod.Done:
        args = json.dumps({"channelId": self.placeholders["<channel-uuid>"], "content": content})
        return self.sh(f"buzz-broker call message.post --args '{args}' "
                       f"--credential-file {credential}", user=user, check=False)

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}\n" + self.sh(
            "systemctl status --no-pager buzz-broker.service; "
            "journalctl -u buzz-broker.service --no-pager -n 30", check=False).stdout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    reason = guest_mod.cannot_boot()
    if reason is not None:
        _loud_skip(reason)
    image = guest_mod.base_image()
    wheels = _wheel_cache()
    work = tmp_path_factory.mktemp("nspawn")
    blocks = {b.step: b for b in install_blocks()}
    with start_devrelay(auth=True) as (relay_url, _relay), guest_mod.booted(
        image, work, binds=[(wheels, GUEST_WHEELS)]
    ) as guest:
        metrics_port = free_port()
        placeholders = {
            "<agent-user>": AGENT,
            "<owner-pubkey-hex>": TestKey().pubkey,
            "<channel-uuid>": str(uuid.uuid4()),
            "<relay-url>": relay_url,
            DOC_METRICS: f"127.0.0.1:{metrics_port}",
            DOC_TCP: f"127.0.0.1:{free_port()}",
        }
        env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": GUEST_WHEELS,
               "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        inst = Installed(guest, placeholders, metrics_port, {}, env)
        _copy_checkout(guest.root)
        # TEST_ONLY["metrics-port"]: the unit step 2 installs listens on the moved port.
        inst.sh(f"sed -i 's/^ListenStream={DOC_METRICS}$/ListenStream=127.0.0.1:{metrics_port}/' "
                "/opt/buzz-broker/src/systemd/buzz-broker-metrics.socket")
        for user in (AGENT, SECOND_AGENT, OUTSIDER):
            inst.sh(f"useradd --create-home --shell /bin/bash {user}")
        for step in STEPS[:STEPS.index("start")]:
            if step == "move-custody":
                continue  # a fresh install has nothing to move: its own test runs it
            inst.block(blocks[step])
            if step == "so-pin":  # both PIN files gone, as the doc leaves them
                _token_block_again(inst, blocks["token"])
            if step == "units":
                # TEST_ONLY["watchdog"]: a short watchdog, so its test takes seconds.
                inst.sh("mkdir -p /etc/systemd/system/buzz-broker.service.d && printf "
                        "'[Service]\\nWatchdogSec=3s\\n' > "
                        "/etc/systemd/system/buzz-broker.service.d/test-watchdog.conf && "
                        f"systemctl daemon-reload && usermod -a -G buzz-agents {SECOND_AGENT}")
        # TEST_ONLY["reboot"]: step 6 asked the custodian (check-config --deep, agent
        # create), which started it; a reboot leaves only its socket listening.
        inst.sh("systemctl stop buzz-custodian.service")
        inst.block(blocks["start"])
        inst.facts["before-first-request"] = inst.show("ActiveState")
        inst.facts["custodian-before-first-request"] = inst.show(
            "ActiveState", "buzz-custodian.service")
        inst.facts["custodian-socket-before"] = inst.show("ActiveState", "buzz-custodian.socket")
        inst.facts["socket-dir"] = inst.sh("stat -c '%U:%G %a' /run/buzz-broker").stdout.strip()
        inst.block(blocks["first-request"])
        inst.facts["after-first-request"] = inst.show("ActiveState")
        inst.facts["custodian-after-first-request"] = inst.show(
            "ActiveState", "buzz-custodian.service")
        inst.facts["status-text"] = inst.show("StatusText")
        inst.block(blocks["check"])
        yield inst


#: What the token block's PIN files are: the PIN file it writes, and what it leaves behind.
_TOKEN_FILES = ("sha256sum /etc/buzz-broker/token-pin; "
                "ls -A /var/lib/buzz-custodian/softhsm; ls -A /var/lib/buzz-custodian/softhsm/tokens")


def _token_block_again(inst: Installed, block: Block) -> None:
    """TEST_ONLY["token-again"]: docs/install.md step 3's token block, run a second time;
    what it did goes to `inst.facts` for test_the_token_block_run_again_changes_nothing."""
    before = inst.sh(_TOKEN_FILES).stdout
    again = inst.block(block, check=False)
    assert again is not None
    inst.facts["token-again-rc"] = str(again.returncode)
    inst.facts["token-again-stderr"] = again.stderr
    inst.facts["token-again-same-files"] = str(inst.sh(_TOKEN_FILES).stdout == before)
    inst.facts["token-again-left"] = inst.sh("ls -A /var/lib/buzz-custodian/softhsm").stdout


# --------------------------------------------------------------------------- the checks


def test_socket_activation_by_the_agents_first_request(installed: Installed) -> None:
    facts = installed.facts
    assert facts["socket-dir"] == "buzz-broker:buzz-agents 750"
    assert facts["before-first-request"] == "inactive"
    assert facts["after-first-request"] == "active"
    assert facts["status-text"].startswith("serving on socket passed by systemd")
    sock = installed.sh("stat -c '%U:%G %a' /run/buzz-broker/broker.sock").stdout.strip()
    assert sock == "root:buzz-agents 660"
    # The service's start did not re-own the directory (RuntimeDirectory= would have).
    assert installed.sh("stat -c '%U:%G' /run/buzz-broker").stdout.strip() == \
        "buzz-broker:buzz-agents"


def test_the_token_block_run_again_changes_nothing(installed: Installed) -> None:
    """docs/install.md step 3's token block run twice: the second run stops at make-token
    (exit 1, its one line), writes no PIN file and leaves the token's PIN file as it was.
    That PIN still opens the token: every later step (keys init, the first request) logs in
    with it."""
    facts = installed.facts
    lines = facts["token-again-stderr"].splitlines()
    assert facts["token-again-rc"] == "1", lines
    assert len(lines) == 1 and lines[0].startswith("make-token: "), lines
    assert facts["token-again-same-files"] == "True"
    assert facts["token-again-left"].split() == ["softhsm2.conf", "tokens"]


def test_type_notify_readiness_and_a_failed_start_fails_the_job(installed: Installed) -> None:
    inst = installed
    inst.sh("systemctl stop buzz-broker.service")
    done = inst.sh("systemctl start buzz-broker.service")
    assert done.returncode == 0
    # start returned: READY=1 was sent, so the daemon is serving right now.
    assert inst.show("ActiveState") == "active" and inst.show("SubState") == "running"
    assert inst.call(AGENT).returncode == 0

    # A config whose custodian socket does not exist: the daemon exits before READY=1.
    inst.sh("sed 's|^custodian_socket = .*|custodian_socket = \"/run/buzz-custodian/no-such.sock\"|' "
            "/etc/buzz-broker/broker.toml > /etc/buzz-broker/broken.toml && "
            "chmod 0644 /etc/buzz-broker/broken.toml && "
            "printf '[Service]\\nEnvironment=BUZZ_BROKER_CONFIG=/etc/buzz-broker/broken.toml\\n'"
            " > /etc/systemd/system/buzz-broker.service.d/test-broken.conf && "
            "systemctl daemon-reload && systemctl stop buzz-broker.service")
    try:
        failed = inst.sh("systemctl start buzz-broker.service", check=False)
        assert failed.returncode != 0, failed.text()
        journal = inst.sh("journalctl -u buzz-broker.service --no-pager -n 20 -o cat").stdout
        assert "no-such.sock" in journal, journal
    finally:
        inst.sh("systemctl stop buzz-broker.service; "
                "rm -f /etc/systemd/system/buzz-broker.service.d/test-broken.conf "
                "/etc/buzz-broker/broken.toml && systemctl daemon-reload && "
                "systemctl reset-failed buzz-broker.service buzz-broker.socket; "
                "systemctl start buzz-broker.socket")
    assert inst.call(AGENT).returncode == 0
    assert inst.show("ActiveState") == "active"


def test_reload_keeps_the_process_and_restart_replaces_it(installed: Installed) -> None:
    inst = installed
    assert inst.call(AGENT).returncode == 0
    pid = inst.show("MainPID")
    inst.sh("systemctl reload buzz-broker.service")
    inst.wait_for("serve.reloaded", lambda: "serve.reloaded" in inst.sh(
        f"journalctl _PID={pid} --no-pager -o cat").stdout)
    inst.wait_for("READY=1 after RELOADING=1", lambda: inst.show("ActiveState") == "active")
    assert inst.show("MainPID") == pid
    assert inst.show("StatusText").endswith("reloaded")
    assert inst.call(AGENT).returncode == 0

    inst.sh("systemctl restart buzz-broker.service")
    assert inst.show("MainPID") not in (pid, "0")
    assert inst.call(AGENT).returncode == 0


def _restarted_once(inst: Installed, after: str, pid: str, restarts: int) -> None:
    """Restart=on-failure brought up a new, ready process, once, and agents get answers."""
    inst.wait_for(f"a restart after {after}", lambda: inst.show("MainPID") not in (pid, "0")
                  and inst.show("ActiveState") == "active")
    assert int(inst.show("NRestarts")) == restarts + 1
    assert inst.call(AGENT).returncode == 0


def test_sigkill_is_restarted_by_restart_on_failure(installed: Installed) -> None:
    inst = installed
    assert inst.call(AGENT).returncode == 0
    pid, restarts = inst.show("MainPID"), int(inst.show("NRestarts"))
    inst.sh(f"kill -KILL {pid}")
    _restarted_once(inst, "SIGKILL", pid, restarts)


def test_watchdog_restarts_a_stuck_daemon(installed: Installed) -> None:
    inst = installed
    assert inst.call(AGENT).returncode == 0
    assert inst.show("WatchdogUSec") == "3s"
    pid, restarts = inst.show("MainPID"), int(inst.show("NRestarts"))
    time.sleep(4.5)  # longer than WatchdogSec: a daemon that did not ping would be gone
    assert inst.show("MainPID") == pid and int(inst.show("NRestarts")) == restarts
    inst.sh(f"kill -STOP {pid}")
    try:
        inst.wait_for("the watchdog timeout", lambda: "Watchdog timeout" in inst.sh(
            "journalctl -u buzz-broker.service --no-pager -o cat -n 50").stdout, timeout=15)
    finally:
        inst.sh(f"kill -CONT {pid}", check=False)  # SIGABRT (WatchdogSignal) lands now
    _restarted_once(inst, "the watchdog", pid, restarts)


def test_uid_bound_credential_is_refused_for_another_uid(installed: Installed) -> None:
    inst = installed
    inst.sh(f"install -m 0400 -o {SECOND_AGENT} /home/{AGENT}/.config/buzz-broker/credential "
            f"/home/{SECOND_AGENT}/stolen-credential")
    assert inst.call(AGENT).returncode == 0
    refused = inst.call(SECOND_AGENT, credential=f"/home/{SECOND_AGENT}/stolen-credential")
    assert refused.returncode == 3, refused.text()
    assert json.loads(refused.stdout)["error"]["code"] == "unauthenticated"


def test_outsider_cannot_reach_the_socket(installed: Installed) -> None:
    inst = installed
    inst.sh(f"install -m 0400 -o {OUTSIDER} /home/{AGENT}/.config/buzz-broker/credential "
            f"/home/{OUTSIDER}/credential")
    done = inst.call(OUTSIDER, credential=f"/home/{OUTSIDER}/credential")
    # `call` says what to do about it (the client's SocketPermissionDenied, exit 1), and
    # nothing reached the daemon: no envelope on stdout.
    assert done.returncode == 1 and done.stdout == "", done.text()
    assert "permission denied on the broker socket" in done.stderr, done.text()
    # Why: the directory is closed to it (EACCES on connect), not a daemon refusal.
    raw = inst.sh("python3 -c \"import socket; socket.socket(socket.AF_UNIX)"
                  ".connect('/run/buzz-broker/broker.sock')\"", user=OUTSIDER, check=False)
    assert raw.returncode != 0 and "PermissionError" in raw.stderr, raw.text()
    assert inst.call(AGENT).returncode == 0  # the same credential works for its own user


def test_metrics_scrape_on_loopback(installed: Installed) -> None:
    inst = installed
    assert inst.call(AGENT).returncode == 0
    blocks = {b.step: b for b in install_blocks()}
    inst.block(blocks["metrics"])  # the doc's scrape, as a user outside buzz-agents
    body = inst.sh(f"curl --silent --fail http://127.0.0.1:{inst.metrics_port}/metrics",
                   user=OUTSIDER).stdout
    assert re.search(r'^buzz_broker_requests_total\{action="message.post",status="succeeded"'
                     r',code=""\} [1-9]', body, re.M), body[:2000]
    assert re.search(r"^process_open_fds [1-9]", body, re.M)
    assert re.search(r'^buzz_broker_build_info\{version="[^"]+",python="3\.11', body, re.M)
    placeholders = inst.placeholders
    for secret_ish in (placeholders["<channel-uuid>"], placeholders["<owner-pubkey-hex>"]):
        assert secret_ish not in body
    # buzz-broker-metrics.socket holds the port (no opt-in in the doc's config): the daemon
    # serves it as held by systemd, and check-config says what each case does.
    assert inst.show("ActiveState", "buzz-broker-metrics.socket") == "active"
    status = inst.sh("buzz-broker-admin status").stdout
    assert re.search(rf"^metrics:\s+serving 127\.0\.0\.1:{inst.metrics_port} \(held by "
                     r"systemd \(socket activation\)\)$", status, re.M), status
    lines = inst.sh("buzz-broker-admin check-config").stdout
    assert (f"metrics: 127.0.0.1:{inst.metrics_port}: served only if systemd passes it "
            "(buzz-broker-metrics.socket)") in lines, lines


def test_tcp_socket_activates_the_service(installed: Installed) -> None:
    """docs/install.md step tcp: buzz-broker-tcp.socket holds the port, an agent's first
    request over loopback TCP starts the stopped service, which serves it as held by
    systemd; the outsider (not in tcp_allow_groups) and a browser-like request get 403."""
    inst = installed
    address = inst.placeholders[DOC_TCP]
    blocks = {b.step: b for b in install_blocks()}
    inst.sh("systemctl stop buzz-broker.service")
    # TEST_ONLY["tcp-port"]: the unit the doc installs listens on the moved port.
    inst.sh(f"sed -i 's/^ListenStream={DOC_TCP}$/ListenStream={address}/' "
            "/opt/buzz-broker/src/systemd/buzz-broker-tcp.socket")
    inst.block(blocks["tcp"])
    assert inst.show("ActiveState", "buzz-broker-tcp.socket") == "active"
    assert inst.show("ActiveState") == "inactive"  # try-restart left it stopped
    pid_before = inst.show("MainPID")
    args = json.dumps({"channelId": inst.placeholders["<channel-uuid>"], "content": "over tcp"})
    done = inst.sh(f"buzz-broker call message.post --socket http://{address} --args '{args}' "
                   "--credential-file ~/.config/buzz-broker/credential", user=AGENT, check=False)
    assert done.returncode == 0, done.text()
    assert json.loads(done.stdout)["status"] == "succeeded", done.text()
    assert inst.show("ActiveState") == "active" and inst.show("MainPID") not in (pid_before, "0")
    local = f"http://localhost:{address.rsplit(':', 1)[1]}"
    done = inst.sh(f"buzz-broker call message.post --socket {local} --args '{args}' "
                   "--credential-file ~/.config/buzz-broker/credential", user=AGENT, check=False)
    assert done.returncode == 0, done.text()
    journal = inst.sh("journalctl -u buzz-broker.service --no-pager -o cat -n 200").stdout
    assert "held by systemd" in journal, journal[-2000:]
    # Not in buzz-agents: refused before a byte of its request is read (it sends none).
    host, _, port = address.rpartition(":")
    raw = inst.sh(f"python3 -c \"import socket; s = socket.create_connection(('{host}', {port}),"
                  " timeout=10); print(s.recv(200).split(b'\\r\\n')[0].decode())\"",
                  user=OUTSIDER, check=False)
    assert raw.stdout.strip() == "HTTP/1.1 403 Forbidden", raw.text()
    # A page's request (Origin), even from the agent's own uid: 403, never judged.
    code = inst.sh(f"curl -s -o /dev/null -w '%{{http_code}}' -X POST "
                   f"-H 'Origin: http://evil.example' http://{address}/v1/action",
                   user=AGENT, check=False).stdout
    assert code == "403", code
    # check-config names the rule (systemd holds the port, else refused).
    lines = inst.sh("buzz-broker-admin check-config").stdout
    assert f"tcp: {address}: served only if systemd passes it" in lines, lines


def test_systemd_analyze_security_at_most_1_5(installed: Installed) -> None:
    out = installed.sh("systemd-analyze security --no-pager buzz-broker.service").stdout
    match = re.search(r"Overall exposure level for buzz-broker\.service: ([0-9.]+)", out)
    assert match, out[-2000:]
    print(f"systemd-analyze security on systemd 252: {match.group(1)}")
    assert float(match.group(1)) <= 1.5, out[-2000:]


def test_journald_priority_finds_warnings_only(installed: Installed) -> None:
    inst = installed
    warning = inst.sh("journalctl -u buzz-broker.service -p warning --no-pager -o cat").stdout
    # The guest cannot raise RLIMIT_MEMLOCK (no CAP_SYS_RESOURCE): mlock_skipped is a warning.
    assert '"event":"serve.mlock_skipped"' in warning, warning[-2000:]
    assert '"event":"serve.ready"' not in warning  # info stays out of -p warning
    everything = inst.sh("journalctl -u buzz-broker.service --no-pager -o cat").stdout
    ready = [line for line in everything.splitlines() if '"event":"serve.ready"' in line]
    assert ready and all(line.startswith("{") for line in ready)  # prefix stripped, JSON kept
    assert json.loads(ready[-1])["level"] == "info"


def test_status_running_then_stopped(installed: Installed) -> None:
    inst = installed
    assert inst.call(AGENT).returncode == 0
    running = inst.sh("buzz-broker-admin status --json", check=False)
    assert running.returncode == 0, running.text()
    facts = json.loads(running.stdout)
    assert facts["daemon"]["pid"] == int(inst.show("MainPID"))
    assert facts["agents"]["live"] == 1 and facts["credentials"]["active"] == 1
    assert facts["relay"]["detail"].startswith(inst.placeholders["<relay-url>"])
    assert facts["audit"]["records"] >= 1 and re.fullmatch(r"[0-9a-f]{64}", facts["audit"]["head"])
    inst.sh("systemctl stop buzz-broker.service")
    stopped = inst.sh("buzz-broker-admin status", check=False)
    assert stopped.returncode == 3, stopped.text()
    assert re.search(r"^daemon: +stopped$", stopped.stdout, re.M)
    assert inst.show("ActiveState") == "inactive"  # status did not activate the socket


def _main_pid(inst: Installed, unit: str) -> str:
    pid = inst.show("MainPID", unit)
    assert pid not in ("", "0"), f"{unit} has no main process"
    return pid


KEYSTORE = "/var/lib/buzz-custodian/keys/keystore.db"


def _daemon_uid_is_locked_out(inst: Installed) -> None:
    """buzz-broker opens neither the PIN, the token, the custodian's configuration nor the
    keystore, which is the custodian's alone and nowhere in the daemon's state."""
    for path in ("/run/credentials/buzz-custodian.service/token-pin", "/etc/buzz-broker/token-pin",
                 "/var/lib/buzz-custodian/softhsm/tokens", "/etc/buzz-custodian/custodian.toml",
                 "/var/lib/buzz-custodian/keys", KEYSTORE):
        denied = inst.sh(f"runuser -u buzz-broker -- ls -d {path}/* {path} >/dev/null 2>&1 || "
                         f"runuser -u buzz-broker -- cat {path} >/dev/null", check=False)
        assert denied.returncode != 0, f"buzz-broker reads {path}"
    # The keystore: there (root sees it), the custodian's alone, and nowhere in the daemon's
    # state; the daemon's uid cannot open it even read-only through SQLite.
    modes = inst.sh(f"stat -c '%U:%G %a' /var/lib/buzz-custodian /var/lib/buzz-custodian/keys "
                    f"{KEYSTORE}").stdout.split("\n")[:3]
    assert modes == ["buzz-custodian:buzz-custodian 700"] * 2 + [
        "buzz-custodian:buzz-custodian 600"], modes
    assert inst.sh(f"test -s {KEYSTORE} && ! ls /var/lib/buzz-broker/keystore.db* 2>/dev/null",
                   check=False).returncode == 0
    sqlite = inst.sh("runuser -u buzz-broker -- /opt/buzz-broker/venv/bin/python -c 'import sqlite3; "
                     f"sqlite3.connect(\"file:{KEYSTORE}?mode=ro\", uri=True)"
                     ".execute(\"SELECT count(*) FROM keys\").fetchone()'", check=False)
    assert sqlite.returncode != 0 and "unable to open" in sqlite.text(), sqlite.text()


def test_the_custodian_step_then_the_first_request_activates_both(installed: Installed) -> None:
    """docs/install.md steps 3 and 6: both units, two uids; the agent's first request starts
    the daemon, whose start starts the custodian; the daemon has no PIN, cannot open the
    token's files nor the keystore and does not map the module, and lists the agents from
    the custodian's records; a SIGKILLed custodian is back by systemd."""
    inst = installed
    facts = inst.facts
    assert (facts["before-first-request"], facts["custodian-before-first-request"],
            facts["custodian-socket-before"]) == ("inactive", "inactive", "active"), facts
    assert (facts["after-first-request"], facts["custodian-after-first-request"]) == (
        "active", "active"), facts
    assert inst.call(AGENT).returncode == 0  # running again after the tests before this one
    daemon, custodian = _main_pid(inst, "buzz-broker.service"), _main_pid(
        inst, "buzz-custodian.service")
    owners = inst.sh(f"stat -c %U /proc/{daemon} /proc/{custodian}").stdout.split()
    assert owners == ["buzz-broker", "buzz-custodian"], owners
    # The module is mapped by the custodian only.
    assert inst.sh(f"grep -c libsofthsm2 /proc/{daemon}/maps", check=False).stdout.strip() == "0"
    assert int(inst.sh(f"grep -c libsofthsm2 /proc/{custodian}/maps").stdout) > 0
    # The PIN is the custodian's credential only; the daemon's uid opens neither it nor the token.
    # (systemctl show prints LoadCredential= as "[unprintable]": look at what was handed over.)
    assert inst.sh("test ! -e /run/credentials/buzz-broker.service/token-pin && "
                   "test -e /run/credentials/buzz-custodian.service/token-pin", check=False
                   ).returncode == 0
    _daemon_uid_is_locked_out(inst)
    # The agent flows: the daemon's uid lists the custodian's agent (the one step 6 made).
    listed = [json.loads(line) for line in inst.sh(
        "buzz-broker-admin agent list --json").stdout.splitlines()]
    assert [(a["name"], a["deletedAt"]) for a in listed] == [("scout", None)], listed
    assert re.fullmatch(r"[0-9a-f]{64}", listed[0]["pubkey"]), listed
    status = json.loads(inst.sh("buzz-broker-admin status --json", check=False).stdout)
    assert status["agents"]["live"] == 1, status
    sock = inst.sh("stat -c '%U:%G %a' /run/buzz-custodian/custodian.sock").stdout.strip()
    assert sock == "buzz-custodian:buzz-broker 660", sock
    # An agent cannot even reach the custodian's socket (not in the group buzz-broker).
    reach = inst.sh("python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); "
                    "s.connect(\"/run/buzz-custodian/custodian.sock\")'", user=AGENT, check=False)
    assert reach.returncode != 0 and "Permission denied" in reach.text(), reach.text()
    # Who restarts it: systemd (Restart=always); the daemon keeps its PID and reconnects.
    inst.sh(f"kill -KILL {custodian}")
    inst.wait_for("the custodian restarted", lambda: inst.show(
        "MainPID", "buzz-custodian.service") not in ("", "0", custodian))
    assert inst.call(AGENT, content="after a SIGKILL of the custodian").returncode == 0
    assert _main_pid(inst, "buzz-broker.service") == daemon
    journal = inst.sh("journalctl -u buzz-custodian.service --no-pager -o cat").stdout
    assert "custodian: listening" in journal, journal[-2000:]
    out = inst.sh("systemd-analyze security --no-pager buzz-custodian.service").stdout
    match = re.search(r"Overall exposure level for buzz-custodian\.service: ([0-9.]+)", out)
    assert match, out[-2000:]
    print(f"systemd-analyze security of the custodian on systemd 252: {match.group(1)}")
    assert float(match.group(1)) <= 1.5, out[-2000:]


def test_the_custodians_recover_and_forget_run_through_its_admin_wrapper(
        installed: Installed) -> None:
    """docs/install.md step 5's `--recover` and `--forget-destroyed` rows and the
    `max_records` runbook's named forget (docs/custodian.md), as root through
    buzz-custodian-admin beside the running custodian: a removed agent comes back, then,
    removed again, is forgotten by name; each command's lines are in the custodian's log,
    which stays the custodian's, its chain one."""
    inst = installed
    custodian = _main_pid(inst, "buzz-custodian.service")
    # TEST_ONLY["spare-agent"]
    spare = inst.sh(f"buzz-broker-admin agent create --owner {TestKey().pubkey} "
                    "--name spare").stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", spare), spare

    def records() -> dict[str, bool]:  # pubkey -> live, tombstones too
        return {a["pubkey"]: a["deletedAt"] is None for a in map(json.loads, inst.sh(
            "buzz-broker-admin agent list --all --json").stdout.splitlines())}

    inst.sh(f"buzz-broker-admin agent remove {spare} --yes >/dev/null")
    assert records()[spare] is False
    usage = inst.sh("buzz-custodian-admin", check=False)
    assert usage.returncode == 2 and "--forget-destroyed [PUBKEY ...]" in usage.stderr, usage.text()
    inst.sh(f"buzz-custodian-admin --recover {spare}", what="buzz-custodian-admin --recover")
    inst.wait_for("the recovered agent live", lambda: records().get(spare) is True)
    inst.sh(f"buzz-broker-admin agent remove {spare} --yes >/dev/null")
    forgot = inst.sh(f"buzz-custodian-admin --forget-destroyed {spare}",
                     what="buzz-custodian-admin --forget-destroyed").stdout
    assert "custodian: forgot 1 records named" in forgot, forgot
    inst.wait_for("the forgotten record gone", lambda: spare not in records())
    assert _main_pid(inst, "buzz-custodian.service") == custodian  # beside it, never stopped
    log = "/var/lib/buzz-custodian/log/signed.jsonl"
    assert inst.sh(f"stat -c %U {log}").stdout.strip() == "buzz-custodian"
    lines = [json.loads(line) for line in inst.sh(f"cat {log}").stdout.splitlines()]
    assert [e["seq"] for e in lines] == list(range(1, len(lines) + 1))
    assert all(b["prev"] == a["hash"] for a, b in zip(lines, lines[1:]))
    ops = [(e["op"], e.get("for"), e.get("agent")) for e in lines if spare in json.dumps(e)]
    assert ops == [("mint", None, spare), ("intent", "destroy", spare), ("destroy", None, spare),
                   ("intent", "recover", spare), ("recover", None, spare),
                   ("intent", "destroy", spare), ("destroy", None, spare),
                   ("intent", "forget", None), ("forget", None, spare)], ops


def _agent_pubkeys(inst: Installed) -> list[str]:
    listed = [json.loads(line) for line in inst.sh(
        "buzz-broker-admin agent list --json").stdout.splitlines()]
    return [a["pubkey"] for a in listed if a["name"] == AGENT and a["deletedAt"] is None]


def _posted_by(inst: Installed, content: str) -> list[str]:
    """The pubkeys that signed the channel's messages with this content (read back through
    the daemon from the relay)."""
    args = json.dumps({"channelId": inst.placeholders["<channel-uuid>"]})
    done = inst.sh(f"buzz-broker call channel.read --args '{args}' "
                   "--credential-file ~/.config/buzz-broker/credential", user=AGENT)
    messages = json.loads(done.stdout)["outcome"]["messages"]
    return [m["pubkey"] for m in messages if m["content"] == content]


def test_a_host_that_ran_custody_in_the_daemon_moves_its_keys(installed: Installed) -> None:
    """docs/install.md 6b: a host installed before the custodian (token, keystore and KEK
    the daemon's, an agent posting) runs step 3's first block, the custodian's
    configuration and the doc's move block; the same agent's pubkey then posts, its first
    request activating both units, and the daemon's uid keeps nothing of the keys."""
    inst = installed
    blocks = {b.step: b for b in install_blocks()}
    # TEST_ONLY["old-layout"]: back to a host that never had a custodian.
    inst.sh("systemctl disable --now buzz-custodian.socket buzz-custodian.service; "
            "systemctl stop buzz-broker.socket buzz-broker.service; "
            "rm -f /etc/systemd/system/buzz-custodian.service /etc/systemd/system/buzz-custodian.socket"
            " /etc/systemd/system/buzz-broker.service.d/custodian.conf; "
            "rm -rf /etc/buzz-custodian /var/lib/buzz-custodian/* && "
            "find /var/lib/buzz-broker -mindepth 1 -delete && systemctl daemon-reload")
    # The install before the custodian (docs/install.md as of its step 3 then).
    inst.sh("runuser -u buzz-broker -- /opt/buzz-broker/venv/bin/python "
            "/opt/buzz-broker/src/softhsm/make-token /var/lib/buzz-broker/softhsm "
            "--label buzz-broker >/dev/null && "
            "install -m 0644 /var/lib/buzz-broker/softhsm/softhsm2.conf /etc/buzz-broker/softhsm2.conf && "
            "install -m 0600 -o root -g root /var/lib/buzz-broker/softhsm/user-pin /etc/buzz-broker/token-pin && "
            "shred -u /var/lib/buzz-broker/softhsm/user-pin /var/lib/buzz-broker/softhsm/so-pin")
    config = Path(inst.guest.root / "etc/buzz-broker/broker.toml")
    old = re.sub(r"^\[custody\]\ncustodian_socket = .*\n",
                 '[pkcs11]\nmodule = "/usr/lib/softhsm/libsofthsm2.so"\ntoken_label = "buzz-broker"\n',
                 config.read_text(), flags=re.M)
    assert "[pkcs11]" in old and "[custody]" not in old, old
    config.write_text(old)
    inst.sh("buzz-broker-admin keys init >/dev/null")
    inst.block(blocks["agent"])
    inst.block(blocks["start"])
    assert inst.call(AGENT, content="custody in the daemon").returncode == 0
    daemon = _main_pid(inst, "buzz-broker.service")
    # Really the old layout: the daemon maps the module itself.
    assert int(inst.sh(f"grep -c libsofthsm2 /proc/{daemon}/maps").stdout) > 0
    [pubkey] = _agent_pubkeys(inst)
    assert _posted_by(inst, "custody in the daemon") == [pubkey]

    inst.block(blocks["custodian"])
    inst.block(blocks["custodian-config"])
    inst.block(blocks["move-custody"])
    # TEST_ONLY["old-layout"]: check-config --deep started the custodian; a reboot would not.
    inst.sh("systemctl stop buzz-custodian.service")
    assert (inst.show("ActiveState"), inst.show("ActiveState", "buzz-custodian.service")) == (
        "inactive", "inactive")
    moved = inst.call(AGENT, content="custody moved to the custodian")
    assert moved.returncode == 0, moved.text()
    assert (inst.show("ActiveState"), inst.show("ActiveState", "buzz-custodian.service")) == (
        "active", "active")
    assert _posted_by(inst, "custody moved to the custodian") == [pubkey]
    assert _agent_pubkeys(inst) == [pubkey]
    daemon = _main_pid(inst, "buzz-broker.service")
    assert inst.sh(f"grep -c libsofthsm2 /proc/{daemon}/maps", check=False).stdout.strip() == "0"
    _daemon_uid_is_locked_out(inst)
    left = inst.sh("find /var/lib/buzz-broker /etc/buzz-broker -printf '%P\\n'").stdout.split()
    assert not [name for name in left if "keystore" in name or "softhsm" in name
                or name.endswith(".object")], left


def test_upgrade_then_uninstall(installed: Installed) -> None:
    inst = installed
    blocks = {b.step: b for b in install_blocks()}
    assert inst.call(AGENT).returncode == 0
    pid = inst.show("MainPID")
    inst.block(blocks["upgrade"])
    assert inst.show("MainPID") not in (pid, "0")
    assert inst.call(AGENT).returncode == 0
    inst.block(blocks["uninstall"])
    assert inst.sh("test ! -e /run/buzz-broker/broker.sock && "
                   "! systemctl cat buzz-broker.service 2>/dev/null", check=False).returncode == 0
