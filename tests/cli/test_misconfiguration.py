"""The misconfigurations an operator makes, each through `check-config --deep` and `serve`, as
an operator runs them (`python -m daemon.cli` subprocesses, the real SoftHSM token and
LocalRelay): one line on stderr, `buzz-broker: ` and what names the key or the file, a
non-zero exit that is not the internal-error one (1 where the fault is the file's), no
traceback, and `serve` leaves no socket behind (nor a state directory it made, where the
fault is the file's).

One table, `CASES`, iterated: a row makes the configuration in a temporary directory and
says what each command's line must hold. A row's `check` is None where `check-config
--deep` rightly passes, and says why: a port someone else holds, a port nobody holds for
the daemon (systemd may pass it at start), or a daemon already running, is a fact of the
moment the daemon starts (under systemd PID 1 holds the ports and the daemon runs while the
operator checks), so only `serve` can find it.

The lower-level checks of each key (every type, every range, every bad value) are
tests/test_config.py's; the second daemon, in process, tests/test_serve.py's.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from daemon.config import SYSTEM_CONFIG
from tests.fixtures.broker import write_config
from custody import TokenConfig

REPO = Path(__file__).resolve().parents[2]
#: EX_SOFTWARE: what `main` answers for an exception nothing named (daemon/cli/__init__.py).
EXIT_INTERNAL = 70


@dataclass
class Setup:
    """What one row is given and what it hands back: the files, and how to run."""

    tmp: Path
    #: the session token, its KEK made (`custody_state`)
    token: TokenConfig
    relay: str
    #: the arguments before the command (`--config PATH`, or none)
    before: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: run each command under this prefix (setpriv), or none
    prefix: list[str] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.tmp / "b.sock"

    @property
    def state(self) -> Path:
        return self.tmp / "state"

    def write(self, **sections: dict[str, object]) -> Path:
        """The good configuration with `sections` laid over it, named by `--config`."""
        path = write_config(self.tmp / "broker.toml", token=self.token,
                            state_dir=self.state, socket=self.socket, relay_url=self.relay,
                            sections=sections)
        self.before = ["--config", str(path)]
        return path

    def pin_copy(self, mode: int) -> str:
        pin = self.tmp / "pin"
        assert self.token.pin_file is not None
        shutil.copyfile(self.token.pin_file, pin)
        pin.chmod(mode)
        return str(pin)


@dataclass(frozen=True)
class Case:
    name: str
    #: makes the files; returns what each line must hold (the key, the file, the remedy)
    setup: Callable[[Setup], list[str]]
    #: False: `check-config --deep` rightly passes (the module docstring says when)
    check: bool = True
    root_only: bool = False
    #: the fault is the file's: `serve` refuses before it makes anything (state dir, lock)
    file_fault: bool = False


def _toml_syntax(s: Setup) -> list[str]:
    path = s.write()
    path.write_text(path.read_text().replace("[relay]", "[relay", 1))
    return [f"config {path}: invalid TOML", "line "]


def _unknown_key(s: Setup) -> list[str]:
    path = s.write(relay={"urll": "wss://relay.example.org"})
    return [f"config {path}: unknown key [relay] urll", "did you mean url?"]


def _wrong_type(s: Setup) -> list[str]:
    path = s.write(server={"max_connections": "many"})
    return [f"config {path}: [server] max_connections: expected an integer", "'many'"]


def _socket_group_past_gid_t(s: Setup) -> list[str]:
    # Once passed by check-config, and `serve` then exited 70 (OverflowError in chown).
    path = s.write(server={"socket_group": 99999999999999999999})
    return [f"config {path}: [server] socket_group: expected a group name or numeric gid",
            "99999999999999999999"]


def _missing_pin(s: Setup) -> list[str]:
    s.write(pkcs11={"pin_file": str(s.tmp / "no-pin")})
    return [f"PIN file {s.tmp / 'no-pin'}", "No such file"]


def _readable_pin(s: Setup) -> list[str]:
    pin = s.pin_copy(0o644)
    s.write(pkcs11={"pin_file": pin})
    return [f"PIN file {pin} is readable by group or others", "chmod 600"]


def _wrong_label(s: Setup) -> list[str]:
    s.write(pkcs11={"token_label": "no-such-token"})
    return ["no token labelled 'no-such-token'"]


def _state_of_another_user(s: Setup) -> list[str]:
    s.write()
    s.state.mkdir(mode=0o700)
    os.chown(s.state, 65534, 65534)
    return [f"refusing to run as root on {s.state}: it belongs to", "buzz-broker-admin"]


def _state_not_writable(s: Setup) -> list[str]:
    s.write()
    s.state.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes anywhere: run it without the capability that allows it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) not installed")
        s.prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]
    return [str(s.state), "Permission denied", "user's to write"]


def _relay_not_ws(s: Setup) -> list[str]:
    path = s.write(relay={"url": "https://relay.example.org"})
    return [f"config {path}: [relay] url: expected a wss:// URL", "https://relay.example.org"]


def _no_relay(s: Setup) -> list[str]:
    path = s.write()
    text = path.read_text()
    path.write_text(text[:text.index("[relay]")])
    return [f"config {path}: [relay] url is not set", 'url = "wss://']


def _tcp_off_loopback(s: Setup) -> list[str]:
    path = s.write(server={"listen_tcp": ["0.0.0.0:7475"], "tcp_allow_uids": [os.getuid()]})
    return [f"config {path}: [server] listen_tcp", "'0.0.0.0:7475' is not", "loopback only"]


@pytest.fixture
def taken_port() -> Iterator[int]:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        yield holder.getsockname()[1]
    finally:
        holder.close()


def _tcp_port_taken(s: Setup) -> list[str]:
    port = s.env.pop("TAKEN_PORT")
    s.write(server={"listen_tcp": [f"127.0.0.1:{port}"], "tcp_allow_uids": [os.getuid()],
                    "listen_tcp_accept_squatting_risk": True})
    return [f"[server] listen_tcp 127.0.0.1:{port}: Address already in use"]


def _metrics_port_taken(s: Setup) -> list[str]:
    port = s.env.pop("TAKEN_PORT")
    s.write(metrics={"listen": f"127.0.0.1:{port}", "listen_accept_squatting_risk": True})
    return [f"[metrics] listen 127.0.0.1:{port}: Address already in use"]


def _metrics_port_unheld(s: Setup) -> list[str]:
    port = s.env.pop("TAKEN_PORT")  # any port >= 1024 will do: nobody need hold it
    s.write(metrics={"listen": f"127.0.0.1:{port}"})
    return [f"[metrics] listen 127.0.0.1:{port}: port {port} is not held for the daemon",
            "any local user may bind it first and answer the scraper",
            "let buzz-broker-metrics.socket hold it", "listen_accept_squatting_risk = true"]


def _second_daemon(s: Setup) -> list[str]:
    first = s.write()
    s.env["FIRST_CONFIG"] = str(first)  # the test starts it; the second names its own socket
    second = write_config(s.tmp / "second.toml", token=s.token, state_dir=s.state,
                          socket=s.tmp / "second.sock", relay_url=s.relay)
    s.before = ["--config", str(second)]
    return [f"another buzz-broker serve (pid ", f"runs on {s.state}"]


def _config_is_a_directory(s: Setup) -> list[str]:
    s.before = ["--config", str(s.tmp)]
    return [f"config {s.tmp}: is a directory, not a file"]


def _config_is_empty(s: Setup) -> list[str]:
    s.write()  # a good file $BUZZ_BROKER_CONFIG names, which an empty --config must not fall to
    s.env["BUZZ_BROKER_CONFIG"] = s.before[1]
    s.before = ["--config", ""]
    return ["--config is empty", "give the file's path"]


def _no_file_at_all(value: str | None) -> Callable[[Setup], list[str]]:
    def setup(s: Setup) -> list[str]:
        if os.path.lexists(SYSTEM_CONFIG):
            pytest.skip(f"{SYSTEM_CONFIG} exists here: it would be read")
        if value is not None:
            s.env["BUZZ_BROKER_CONFIG"] = value
        s.before = []
        return ["no configuration file", "--config", "$BUZZ_BROKER_CONFIG", SYSTEM_CONFIG,
                "[relay] url is not set"]
    return setup


CASES = [
    Case("toml-syntax-error", _toml_syntax, file_fault=True),
    Case("unknown-key", _unknown_key, file_fault=True),
    Case("wrong-type", _wrong_type, file_fault=True),
    Case("socket-group-past-gid-t", _socket_group_past_gid_t, file_fault=True),
    Case("pin-file-missing", _missing_pin),
    Case("pin-file-world-readable", _readable_pin),
    Case("wrong-token-label", _wrong_label),
    Case("state-dir-of-another-user", _state_of_another_user, root_only=True),
    Case("state-dir-not-writable", _state_not_writable),
    Case("relay-url-not-ws", _relay_not_ws, file_fault=True),
    Case("relay-url-missing", _no_relay, file_fault=True),
    Case("listen-tcp-off-loopback", _tcp_off_loopback, file_fault=True),
    Case("listen-tcp-port-in-use", _tcp_port_taken, check=False),
    Case("metrics-port-in-use", _metrics_port_taken, check=False),
    Case("metrics-port-unheld", _metrics_port_unheld, check=False),
    Case("two-daemons-one-state-dir", _second_daemon, check=False),
    Case("config-is-a-directory", _config_is_a_directory, file_fault=True),
    Case("config-option-empty", _config_is_empty, file_fault=True),
    Case("env-unset-no-file", _no_file_at_all(None)),
    Case("env-empty-no-file", _no_file_at_all("")),
]


def _env(extra: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in (
        "BUZZ_BROKER_CONFIG", "CREDENTIALS_DIRECTORY", "NOTIFY_SOCKET", "LISTEN_FDS",
        "LISTEN_PID", "WATCHDOG_USEC")}
    return {**base, **extra}


def _run(s: Setup, *command: str) -> subprocess.CompletedProcess[str]:
    argv = [*s.prefix, sys.executable, "-m", "daemon.cli", *s.before, *command]
    try:
        return subprocess.run(argv, cwd=REPO, env=_env(s.env), capture_output=True, text=True,
                              timeout=90)
    except subprocess.TimeoutExpired as exc:  # it started: the misconfiguration went unseen
        raise AssertionError(f"{' '.join(command)} did not refuse: {exc.stderr!r}") from None


def _the_one_line(done: subprocess.CompletedProcess[str], wanted: list[str]) -> str:
    """The stderr line that is not the daemon's JSON log: exactly one, holding `wanted`."""
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode not in (0, EXIT_INTERNAL), (done.returncode, done.stderr)
    lines = [line for line in done.stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1 and lines[0].startswith("buzz-broker: "), done.stderr
    for part in wanted:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def _start_first(s: Setup) -> subprocess.Popen[str]:
    first = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--config",
                              s.env.pop("FIRST_CONFIG"), "serve"], cwd=REPO, env=_env({}),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    while not s.socket.is_socket():
        assert first.poll() is None and time.monotonic() < deadline, "the first daemon did not start"
        time.sleep(0.05)
    return first


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_misconfiguration_is_one_line_through_check_config_and_serve(
    case: Case, tmp_path: Path, custody_state: tuple[TokenConfig, Path], local_relay: str,
    taken_port: int,
) -> None:
    if case.root_only and os.geteuid() != 0:
        pytest.skip("only root is refused a state directory another user owns")
    s = Setup(tmp_path, custody_state[0], local_relay, env={"TAKEN_PORT": str(taken_port)})
    wanted = case.setup(s)
    s.env.pop("TAKEN_PORT", None)
    first = _start_first(s) if "FIRST_CONFIG" in s.env else None
    try:
        checked = _run(s, "check-config", "--deep")
        if case.check:
            _the_one_line(checked, wanted)
        else:
            assert checked.returncode == 0 and checked.stdout.endswith("ok\n"), checked.stderr
        served = _run(s, "serve")
        _the_one_line(served, wanted)
    finally:
        if first is not None:
            first.terminate()
            first.wait(timeout=30)
    if first is None:
        assert not s.socket.exists(), "serve left its socket behind"
    if case.file_fault:
        assert not s.state.exists(), "a configuration error made the state directory"
        # docs/configuration.md: "one line naming the file and the key (exit 1)".
        assert (checked.returncode, served.returncode) == (1, 1)


def _state_file(path: Path) -> None:
    path.write_text("not a directory\n")


def _state_fifo(path: Path) -> None:
    os.mkfifo(path)


def _state_device(path: Path) -> None:
    path.symlink_to("/dev/zero")


@pytest.mark.parametrize("make", [_state_file, _state_fifo, _state_device],
                         ids=["regular-file", "fifo", "symlink-to-dev-zero"])
def test_a_state_dir_that_is_not_a_directory_is_one_line_for_every_state_command(
    make: Callable[[Path], None], tmp_path: Path, custody_state: tuple[TokenConfig, Path],
) -> None:
    # It read as an empty host: `agent list` and `credential list` printed nothing and
    # exited 0, check-config said ok, `status` and `agent create` named other remedies.
    s = Setup(tmp_path, custody_state[0], "ws://127.0.0.1:1")
    s.write()
    make(s.state)
    for command in (["agent", "list"], ["credential", "list"], ["status"], ["check-config"],
                    ["agent", "create", "--owner", "ab" * 32, "--name", "x"],
                    ["audit", "verify"]):
        _the_one_line(_run(s, *command), [f"[state] dir {s.state} is not a directory"])
    assert s.state.is_symlink() or not s.state.is_dir()  # left as it was


def test_a_state_dir_under_a_file_is_one_line(tmp_path: Path,
                                              custody_state: tuple[TokenConfig, Path]) -> None:
    s = Setup(tmp_path, custody_state[0], "ws://127.0.0.1:1")
    (tmp_path / "file").write_text("")
    path = write_config(tmp_path / "broker.toml", token=s.token, state_dir=tmp_path / "file" / "state",
                        socket=s.socket, relay_url=s.relay)
    s.before = ["--config", str(path)]
    for command in (["agent", "list"], ["check-config"]):
        _the_one_line(_run(s, *command), [f"[state] dir {tmp_path / 'file' / 'state'}",
                                          "Not a directory"])
