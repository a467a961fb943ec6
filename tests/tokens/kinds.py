"""Start a PKCS#11 token of each kind the custody suite runs on, in a temp dir, no hardware.

Kinds (`KINDS`, the one table the runner, the fixtures, the probes and the Makefile read):
- `softhsm`: SoftHSM2, made by softhsm/make-token (as the main suite does).
- `tpm`: tpm2-pkcs11 on a software TPM 2.0: `swtpm socket` (TCP on loopback), a session
  `dbus-daemon` and `tpm2-abrmd` (the resource manager `tpm2_ptool` needs), the dictionary
  lockout relaxed (else three wrong PINs lock the TPM for 1,000 s), `tpm2_ptool init` and
  `addtoken`. The TPM cannot C_GenerateKey: `add_tpm_keys` makes operator keys with
  `tpm2_ptool addkey` instead.
- `opencryptoki`: opencryptoki's software token (`libpkcs11_sw.so`) behind `pkcsslotd`.
  Its paths are compiled in (/etc/opencryptoki, /var/lib/opencryptoki, /run, /dev/shm), so
  everything runs in a private mount + IPC namespace (`unshare -m -i`) with those paths
  bind-mounted from the temp dir; clients must run in that namespace (`with-token` runs
  the command there). Mounting needs root (CI runs as root, `.ci/run`).
- `p11kit`: a SoftHSM2 token reached through `p11-kit server` over a Unix socket, through
  `p11-kit-client.so`: the shape of a remote token. The client never sees SOFTHSM2_CONF.

Rules:
- Every daemon is started as a direct child in the foreground (never `--daemon`: a
  daemonised process is re-parented to PID 1 and outlives us) and is terminated and reaped
  by `start`'s exit, in reverse order, whatever ended the block.
- PINs are random, written once to 0600 files in the temp dir. Some tools only take PINs
  on their command line (`pkcsconf`, `tpm2_ptool`): acceptable for a throwaway test token
  in a private temp dir, and said in docs/install.md for an operator's real token.
- `start` yields the environment a client needs: BUZZ_TEST_TOKEN_KIND, _MODULE, _LABEL,
  _PIN_FILE, _SO_PIN_FILE, _DIR, plus the module's own variables. tests/fixtures/token.py
  reads the BUZZ_TEST_TOKEN_* ones.

WARNING: `KINDS` is also the mechanism table the probe (tests/tokens/test_mechanisms.py)
asserts, transcribed from the field lab's measurements; change it only with a measurement.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.fixtures.stop import terminate_then_kill

REPO = Path(__file__).resolve().parents[2]
MAKE_TOKEN = REPO / "softhsm" / "make-token"
TOKEN_LABEL = "buzz-test"
#: opencryptoki's PIN length limits are 4-8; the other kinds take longer ones.
OCK_PIN_LENGTH = 8
PIN_LENGTH = 32
PIN_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
#: How long one daemon may take to come up before the start is abandoned.
READY_SECONDS = 20.0
#: How long a daemon gets after SIGTERM before SIGKILL.
STOP_SECONDS = 5.0

ENV_KIND = "BUZZ_TEST_TOKEN_KIND"
ENV_MODULE = "BUZZ_TEST_TOKEN_MODULE"
ENV_LABEL = "BUZZ_TEST_TOKEN_LABEL"
ENV_PIN_FILE = "BUZZ_TEST_TOKEN_PIN_FILE"
ENV_SO_PIN_FILE = "BUZZ_TEST_TOKEN_SO_PIN_FILE"
ENV_DIR = "BUZZ_TEST_TOKEN_DIR"

_MULTIARCH = ("x86_64-linux-gnu", "aarch64-linux-gnu")


@dataclass(frozen=True)
class Kind:
    """What a token kind is and offers (measured: ../shared/field-lab.md, the probe)."""

    name: str
    #: Module path candidates, first existing wins.
    modules: tuple[str, ...]
    #: Debian packages it needs (the Makefile installs them).
    packages: tuple[str, ...]
    #: Mechanism name -> offered, as the probe sees it through python-pkcs11.
    offers: Mapping[str, bool]
    #: The field lab's measured cost of one unseal, upper end (ms): what a test of
    #: thousands of unseals costs on this kind (marker `token_unseals`).
    unseal_ms: float


def _lib_paths(*relative: str) -> tuple[str, ...]:
    return tuple(f"/usr/lib/{arch}/{rel}" for rel in relative for arch in _MULTIARCH)


#: CKM_AES_GCM with a host IV, CKM_AES_ECB, CKM_SHA256_HMAC, C_GenerateKey of an AES key,
#: C_CreateObject of an AES key of a known value (a test's known-answer key), and whether
#: such a key is marked as once readable (probe.py).
KINDS: dict[str, Kind] = {
    "softhsm": Kind(
        "softhsm",
        ("/usr/lib/softhsm/libsofthsm2.so", *_lib_paths("softhsm/libsofthsm2.so")),
        ("softhsm2",),
        {"AES_GCM": True, "AES_ECB": True, "SHA256_HMAC": True, "GENERATE_KEY": True,
         "CREATE_AES_KEY": True, "MARKS_IMPORTED_KEYS": True},
        0.10,
    ),
    "tpm": Kind(
        "tpm",
        _lib_paths("pkcs11/libtpm2_pkcs11.so", "libtpm2_pkcs11.so.1"),
        ("swtpm", "swtpm-tools", "tpm2-tools", "tpm2-abrmd", "libtss2-tcti-tabrmd0",
         "libtpm2-pkcs11-1", "libtpm2-pkcs11-tools", "dbus"),
        {"AES_GCM": False, "AES_ECB": True, "SHA256_HMAC": True, "GENERATE_KEY": False,
         "CREATE_AES_KEY": False, "MARKS_IMPORTED_KEYS": False},
        15.0,
    ),
    "opencryptoki": Kind(
        "opencryptoki",
        _lib_paths("opencryptoki/libopencryptoki.so.0", "pkcs11/libopencryptoki.so"),
        ("opencryptoki", "util-linux"),
        # An imported key reads back ALWAYS_SENSITIVE and NEVER_EXTRACTABLE true.
        {"AES_GCM": False, "AES_ECB": True, "SHA256_HMAC": True, "GENERATE_KEY": True,
         "CREATE_AES_KEY": True, "MARKS_IMPORTED_KEYS": False},
        0.08,
    ),
    "p11kit": Kind(
        "p11kit",
        _lib_paths("pkcs11/p11-kit-client.so"),
        ("p11-kit", "p11-kit-modules", "softhsm2"),
        {"AES_GCM": False, "AES_ECB": True, "SHA256_HMAC": True, "GENERATE_KEY": True,
         "CREATE_AES_KEY": True, "MARKS_IMPORTED_KEYS": True},
        0.45,
    ),
}


class StartFailed(Exception):
    """A token could not be started: one line naming the step (never a PIN)."""


def find_module(kind: Kind) -> str:
    for candidate in kind.modules:
        if Path(candidate).is_file():
            return candidate
    raise StartFailed(f"{kind.name}: no PKCS#11 module (install {' '.join(kind.packages)})")


def new_pin(length: int = PIN_LENGTH) -> str:
    return "".join(secrets.choice(PIN_ALPHABET) for _ in range(length))


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text + "\n")


def read_pin(path: str | Path) -> str:
    return Path(path).read_text(encoding="ascii").strip()


def _run(argv: list[str], env: Mapping[str, str] | None = None, *, stdin: str | None = None,
         what: str, secrets_in_argv: bool = False) -> str:
    """Run a setup tool; on failure raise StartFailed naming it (argv omitted if it holds a PIN)."""
    done = subprocess.run(argv, env=dict(env) if env is not None else None, input=stdin,
                          capture_output=True, text=True, check=False, timeout=120)
    if done.returncode != 0:
        shown = argv[0] if secrets_in_argv else " ".join(argv)
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no message"]
        raise StartFailed(f"{what}: `{shown}` exited {done.returncode}: {tail[0]}")
    return done.stdout


class Children:
    """The daemons a token needs: direct children, stopped and reaped in reverse order."""

    def __init__(self) -> None:
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: Mapping[str, str], log: Path,
              **popen: object) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc: subprocess.Popen[bytes] = subprocess.Popen(
                argv, env=dict(env), stdin=subprocess.DEVNULL,
                stdout=popen.pop("stdout", out), stderr=out, **popen)  # type: ignore[call-overload]
        self._procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise StartFailed(f"{name} exited early (status {proc.returncode})")

    def stop_all(self) -> None:
        for _, proc in reversed(self._procs):
            terminate_then_kill(proc, STOP_SECONDS)
        self._procs.clear()


def _wait_until(ready: object, children: Children, what: str) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        children.check_alive()
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise StartFailed(f"{what} did not come up within {READY_SECONDS:.0f} s")


def _tcp_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _free_port_pair() -> int:
    """A loopback port P with P+1 also free (swtpm's server and control ports)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return int(port)
    raise StartFailed("no free pair of loopback ports for swtpm")


# --- the kinds -------------------------------------------------------------------------


def _softhsm_token(directory: Path) -> dict[str, str]:
    """Run softhsm/make-token in `directory`: returns SOFTHSM2_CONF, module, pin_file."""
    out = _run([sys.executable, str(MAKE_TOKEN), str(directory), "--label", TOKEN_LABEL],
               what="softhsm/make-token")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@contextlib.contextmanager
def _start_softhsm(directory: Path, children: Children) -> Iterator[dict[str, str]]:
    facts = _softhsm_token(directory / "softhsm")
    yield {
        ENV_MODULE: facts["module"],
        ENV_PIN_FILE: facts["pin_file"],
        ENV_SO_PIN_FILE: str(directory / "softhsm" / "so-pin"),
        "SOFTHSM2_CONF": facts["SOFTHSM2_CONF"],
    }


@contextlib.contextmanager
def _start_p11kit(directory: Path, children: Children) -> Iterator[dict[str, str]]:
    facts = _softhsm_token(directory / "softhsm")
    sock = directory / "p11-kit.sock"
    server_env = dict(os.environ, SOFTHSM2_CONF=facts["SOFTHSM2_CONF"])
    children.start("p11-kit server",
                   ["p11-kit", "server", "--foreground", "--provider", facts["module"],
                    "--name", str(sock), f"pkcs11:token={TOKEN_LABEL}"],
                   server_env, directory / "p11-kit.log", stdout=subprocess.DEVNULL)
    _wait_until(sock.exists, children, "p11-kit server")
    yield {
        ENV_MODULE: find_module(KINDS["p11kit"]),
        ENV_PIN_FILE: facts["pin_file"],
        ENV_SO_PIN_FILE: str(directory / "softhsm" / "so-pin"),
        "P11_KIT_SERVER_ADDRESS": f"unix:path={sock}",
    }


def _tpm_env(directory: Path, bus: str) -> dict[str, str]:
    tcti = "tabrmd:bus_type=session"
    return {
        "DBUS_SESSION_BUS_ADDRESS": bus,
        "TPM2_PKCS11_TCTI": tcti,
        "TPM2TOOLS_TCTI": tcti,
        "TPM2_PKCS11_STORE": str(directory / "tpm2-pkcs11"),
        # tpm2-pkcs11 logs every refused mechanism at warning level otherwise.
        "TPM2_PKCS11_LOG_LEVEL": "0",
    }


@contextlib.contextmanager
def _start_tpm(directory: Path, children: Children) -> Iterator[dict[str, str]]:
    state = directory / "tpmstate"
    state.mkdir(mode=0o700)
    port = _free_port_pair()
    base = dict(os.environ)
    children.start("swtpm",
                   ["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={state}",
                    "--server", f"type=tcp,port={port},bindaddr=127.0.0.1",
                    "--ctrl", f"type=tcp,port={port + 1},bindaddr=127.0.0.1",
                    "--flags", "not-need-init,startup-clear"],
                   base, directory / "swtpm.log")
    _wait_until(lambda: _tcp_open(port), children, "swtpm")
    bus_path = directory / "dbus.sock"
    bus = f"unix:path={bus_path}"
    children.start("dbus-daemon", ["dbus-daemon", "--session", "--nofork", "--nosyslog",
                                   f"--address={bus}"], base, directory / "dbus.log")
    _wait_until(bus_path.exists, children, "dbus-daemon")
    env = dict(base, **_tpm_env(directory, bus))
    abrmd = ["tpm2-abrmd", "--session", "--flush-all", f"--tcti=swtpm:host=127.0.0.1,port={port}"]
    if os.geteuid() == 0:
        abrmd.append("--allow-root")
    children.start("tpm2-abrmd", abrmd, env, directory / "tpm2-abrmd.log")
    lockout = ["tpm2_dictionarylockout", "--setup-parameters", "--max-tries=1000",
               "--recovery-time=0", "--lockout-recovery-time=0"]
    # tpm2-abrmd is ready once it owns its bus name: the first command that gets through.
    _wait_until(lambda: subprocess.run(lockout, env=env, capture_output=True,
                                       check=False).returncode == 0,
                children, "tpm2-abrmd")
    store = Path(env["TPM2_PKCS11_STORE"])
    store.mkdir(mode=0o700)
    pin_file, so_pin_file = directory / "user-pin", directory / "so-pin"
    write_private(pin_file, new_pin())
    write_private(so_pin_file, new_pin())
    _run(["tpm2_ptool", "init", f"--path={store}"], env, what="tpm2_ptool init")
    _run(["tpm2_ptool", "addtoken", "--pid=1", f"--label={TOKEN_LABEL}",
          f"--userpin={read_pin(pin_file)}", f"--sopin={read_pin(so_pin_file)}",
          f"--path={store}"], env, what="tpm2_ptool addtoken", secrets_in_argv=True)
    yield {
        ENV_MODULE: find_module(KINDS["tpm"]),
        ENV_PIN_FILE: str(pin_file),
        ENV_SO_PIN_FILE: str(so_pin_file),
        **_tpm_env(directory, bus),
    }


def add_tpm_keys(label: str, *, algorithms: Mapping[str, str] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
    """Make operator keys in the TPM token: `tpm2_ptool addkey` (the TPM cannot C_GenerateKey).

    Args:
        label: the key label for the AES-256 key; the HMAC-SHA256 key gets `<label>-mac`
            (the portable seal's pair). `algorithms` overrides: key label -> algorithm.
        env: the token's environment (default os.environ, as `with-token tpm` sets it).
    Raises:
        StartFailed: tpm2_ptool refused (its last line, never the PIN).
    """
    env = dict(os.environ if env is None else env)
    wanted = algorithms if algorithms is not None else {label: "aes256", f"{label}-mac": "hmac:sha256"}
    pin = read_pin(env[ENV_PIN_FILE])
    for key_label, algorithm in wanted.items():
        _run(["tpm2_ptool", "addkey", f"--label={env[ENV_LABEL]}", f"--key-label={key_label}",
              f"--algorithm={algorithm}", f"--userpin={pin}",
              f"--path={env['TPM2_PKCS11_STORE']}"],
             env, what=f"tpm2_ptool addkey {key_label}", secrets_in_argv=True)


#: The directories opencryptoki 3.8 has compiled in, and what replaces each in the namespace.
_OCK_BINDS = {"/etc/opencryptoki": "etc", "/var/lib/opencryptoki": "var"}
_OCK_CONF = "version opencryptoki-3.1\nslot 0\n{\nstdll = libpkcs11_sw.so\ntokname = swtok\n}\n"
#: The SO PIN an opencryptoki token ships with (pkcsconf's documented default).
_OCK_DEFAULT_SO_PIN = "87654321"
#: Compiled into pkcsslotd / libopencryptoki 3.8 (as /var/run/…, /var/lock/…).
_OCK_SOCKET = "/run/pkcsslotd.socket"
_OCK_LOCK_DIR = "/run/lock/opencryptoki"


def _mount(*argv: str) -> None:
    _run(["mount", *argv], what="mount")


@contextlib.contextmanager
def _start_opencryptoki(directory: Path, children: Children) -> Iterator[dict[str, str]]:
    """Must run inside a private mount + IPC namespace (`with-token` enters one)."""
    if os.environ.get("_BUZZ_TOKEN_NAMESPACE") != "1":
        raise StartFailed("opencryptoki must start inside `unshare -m -i` (use with-token)")
    for target, name in _OCK_BINDS.items():
        source = directory / name
        source.mkdir(mode=0o770)
        _mount("--bind", str(source), target)
    (directory / "etc" / "opencryptoki.conf").write_text(_OCK_CONF, encoding="ascii")
    tok_obj = directory / "var" / "swtok" / "TOK_OBJ"
    tok_obj.mkdir(parents=True)
    # A private /run and /dev/shm: pkcsslotd's socket and pid file, and its shared memory.
    _mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run")
    _mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm")
    # /var/run and /var/lock are links into /run: the socket, pid file and API lock live there.
    os.makedirs(_OCK_LOCK_DIR, mode=0o770)
    for path in (directory / "var", directory / "var" / "swtok", tok_obj, Path(_OCK_LOCK_DIR)):
        shutil.chown(path, group="pkcs11")
        os.chmod(path, 0o770)
    children.start("pkcsslotd", ["pkcsslotd", "-f"], dict(os.environ),
                   directory / "pkcsslotd.log")
    _wait_until(lambda: Path(_OCK_SOCKET).exists(), children,
                "pkcsslotd")
    pin_file, so_pin_file = directory / "user-pin", directory / "so-pin"
    write_private(pin_file, new_pin(OCK_PIN_LENGTH))
    write_private(so_pin_file, new_pin(OCK_PIN_LENGTH))
    user, so = read_pin(pin_file), read_pin(so_pin_file)
    steps = [
        (["pkcsconf", "-c", "0", "-I", "-S", _OCK_DEFAULT_SO_PIN], f"{TOKEN_LABEL}\n", "init token"),
        (["pkcsconf", "-c", "0", "-P", "-S", _OCK_DEFAULT_SO_PIN, "-n", so], None, "set SO PIN"),
        (["pkcsconf", "-c", "0", "-u", "-S", so, "-n", user], None, "init user PIN"),
        # A PIN set by the SO must be changed by the user before it is usable.
        (["pkcsconf", "-c", "0", "-p", "-U", user, "-n", user[::-1]], None, "change user PIN"),
        (["pkcsconf", "-c", "0", "-p", "-U", user[::-1], "-n", user], None, "change user PIN back"),
    ]
    for argv, stdin, what in steps:
        _run(argv, stdin=stdin, what=f"pkcsconf {what}", secrets_in_argv=True)
    yield {
        ENV_MODULE: find_module(KINDS["opencryptoki"]),
        ENV_PIN_FILE: str(pin_file),
        ENV_SO_PIN_FILE: str(so_pin_file),
    }


_STARTERS = {
    "softhsm": _start_softhsm,
    "tpm": _start_tpm,
    "opencryptoki": _start_opencryptoki,
    "p11kit": _start_p11kit,
}
#: Kinds whose clients must share the token's private mount namespace.
NEEDS_NAMESPACE = frozenset({"opencryptoki"})


@contextlib.contextmanager
def start(kind: str, *, keep: bool = False) -> Iterator[dict[str, str]]:
    """Start a token of `kind` in a new temp dir; yield the variables a client needs.

    Raises:
        StartFailed: an unknown kind, a missing package, or a step that failed (named).
    """
    if kind not in KINDS:
        raise StartFailed(f"unknown token kind {kind!r} (one of: {', '.join(KINDS)})")
    directory = Path(tempfile.mkdtemp(prefix=f"buzz-token-{kind}-"))
    os.chmod(directory, 0o700)
    children = Children()
    try:
        with _STARTERS[kind](directory, children) as facts:
            yield {ENV_KIND: kind, ENV_LABEL: TOKEN_LABEL, ENV_DIR: str(directory), **facts}
    finally:
        children.stop_all()
        if keep:
            print(f"with-token: kept {directory}", file=sys.stderr)
        else:
            shutil.rmtree(directory, ignore_errors=True)
