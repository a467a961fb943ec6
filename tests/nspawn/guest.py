"""A Debian 12 guest with systemd as PID 1, booted with systemd-nspawn, for the unit tests.

Rules:
- The base tree is built once with debootstrap (minbase + `PACKAGES`) from the Debian
  mirror apt on this machine is configured with (read from the apt sources at run time,
  never written into the repository), and cached OUTSIDE the checkout under `CACHE`
  (``$BUZZ_BROKER_TEST_CACHE``, else /var/cache/buzz-broker-tests) keyed by a hash of the
  suite and package list. A half-built tree is never used: it is built in a scratch
  directory and renamed into place under a lock. A wheel cache lives beside it.
- Each boot gets a fresh copy of the base tree, removed when the guest stops.
- The flags are the ones field-lab.md measured: `--register=no --keep-unit` only when the
  host's PID 1 is not systemd (no machined); `SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1` plus
  CAP_BPF/CAP_NET_ADMIN/CAP_PERFMON and the bpf syscall so the guest's IP firewall works;
  `--console=read-only` under `setsid`. The guest shares the host's network (a relay the
  test runs on the host loopback is reachable from the guest).
- Commands run in the guest through `nsenter` into its PID 1's namespaces, never a shell
  string built from untrusted text (the test's own strings only).
- `cannot_boot()` names why this machine cannot boot a container (not root, a tool
  missing, no cgroup v2 at all); the test skips only on that, and says so loudly.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CACHE",
    "PACKAGES",
    "SUITE",
    "Guest",
    "cannot_boot",
    "debian_mirror",
    "base_image",
    "booted",
]

CACHE = Path(os.environ.get("BUZZ_BROKER_TEST_CACHE") or "/var/cache/buzz-broker-tests")
SUITE = "bookworm"
#: A minimal Debian 12 with systemd as PID 1 (dbus for systemctl), what docs/install.md
#: step 1 installs (pre-installed here so a run needs no package download) and curl for the
#: metrics scrape. procps is left out on purpose: a minimal host lacks it, and the unit's
#: ExecReload= must not need it.
PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "softhsm2", "opensc",
    "curl", "ca-certificates",
)
NSPAWN = "systemd-nspawn"


def _apt_sources_text() -> str:
    parts = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.suffix in (".list", ".sources") and path.is_file():
            with contextlib.suppress(OSError):
                parts.append(path.read_text())
    return "\n".join(parts)


def debian_mirror(text: str | None = None) -> str | None:
    """The first Debian archive URI apt uses for `SUITE` (deb822 or one-line form)."""
    text = _apt_sources_text() if text is None else text
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {
            m.group(1).lower(): m.group(2).strip()
            for m in re.finditer(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M)
        }
        if "deb" in fields.get("types", "").split() and SUITE in fields.get("suites", "").split():
            for uri in fields.get("uris", "").split():
                if not uri.rstrip("/").endswith("-security"):
                    return uri
    for line in text.splitlines():
        words = [w for w in line.split() if not w.startswith("[")]
        if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE:
            return words[1]
    return None


def cannot_boot() -> str | None:
    """Why this machine cannot boot a systemd container, or None when it can."""
    if os.geteuid() != 0:
        return "not root (systemd-nspawn and debootstrap need root)"
    for tool in (NSPAWN, "debootstrap", "nsenter", "setsid"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make test installs systemd-container and debootstrap)"
    if not any(Path(p).exists() for p in ("/sys/fs/cgroup/cgroup.controllers",
                                           "/sys/fs/cgroup/unified/cgroup.controllers")):
        return "the host mounts no cgroup v2 hierarchy (neither unified nor hybrid)"
    if debian_mirror() is None and not _image_dir().exists():
        return f"apt has no Debian {SUITE} mirror configured to build the guest from"
    return None


def _image_key() -> str:
    return hashlib.sha256(f"{SUITE} minbase {' '.join(PACKAGES)}".encode()).hexdigest()[:12]


def _image_dir() -> Path:
    return CACHE / f"{SUITE}-{_image_key()}"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def base_image() -> Path:
    """The cached base tree, built (about 3 minutes) on first use."""
    image = _image_dir()
    with _locked("image"):
        if (image / "etc" / "os-release").exists():
            return image
        mirror = debian_mirror()
        if mirror is None:
            raise RuntimeError(f"no Debian {SUITE} mirror in the apt sources")
        scratch = CACHE / f".build-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        done = subprocess.run(
            ["debootstrap", "--variant=minbase", "--include=" + ",".join(PACKAGES),
             SUITE, str(scratch), mirror],
            capture_output=True, text=True, timeout=1200,
        )
        if done.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            raise RuntimeError("debootstrap failed: " + done.stdout[-1500:] + done.stderr[-1500:])
        # The guest's apt lists and caches are not needed at run time.
        shutil.rmtree(scratch / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        (scratch / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True)
        scratch.rename(image)
        return image


@dataclass
class Done:
    """What a guest command returned."""

    returncode: int
    stdout: str
    stderr: str

    def text(self) -> str:
        return f"rc={self.returncode}\nstdout: {self.stdout[-3000:]}\nstderr: {self.stderr[-3000:]}"


class GuestError(AssertionError):
    """A guest command that had to succeed did not."""


class Guest:
    """A booted guest: `run` a command in it, as root or as a user."""

    def __init__(self, root: Path, process: subprocess.Popen[bytes], leader: int) -> None:
        self.root = root
        self.process = process
        self.leader = leader

    def run(self, argv: Sequence[str], *, user: str | None = None, input: str | None = None,
            env: dict[str, str] | None = None, check: bool = True, timeout: float = 120) -> Done:
        """Run `argv` in the guest (as `user`, via runuser, when given)."""
        inner = list(argv)
        if user is not None:
            inner = ["runuser", "-u", user, "--", *inner]
        environment = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                       "LANG": "C.UTF-8", "HOME": "/root", **(env or {})}
        command = ["nsenter", "-t", str(self.leader), "-a", "--",
                   "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in environment.items()), *inner]
        done = subprocess.run(command, input=input, capture_output=True, text=True,
                              timeout=timeout)
        result = Done(done.returncode, done.stdout, done.stderr)
        if check and done.returncode != 0:
            raise GuestError(f"guest command failed: {inner}\n{result.text()}")
        return result



def _pid1_of(nspawn: int, deadline: float) -> int:
    children = Path(f"/proc/{nspawn}/task/{nspawn}/children")
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            words = children.read_text().split()
            if words:
                return int(words[0])
        time.sleep(0.1)
    raise RuntimeError("the guest's PID 1 did not appear")


@contextlib.contextmanager
def booted(image: Path, work: Path, *, binds: Sequence[tuple[Path, str]] = ()) -> Iterator[Guest]:
    """Copy `image` under `work`, boot it, yield the running guest, power it off."""
    root = work / "root"
    subprocess.run(["cp", "-a", "--reflink=auto", str(image), str(root)], check=True)
    # A fixed machine id keeps journald quiet; hostname for readable logs.
    (root / "etc" / "hostname").write_text("buzz-guest\n")
    flags = ["--boot", f"--directory={root}", "--console=read-only",
             "--capability=CAP_BPF,CAP_NET_ADMIN,CAP_PERFMON", "--system-call-filter=bpf",
             f"--machine=buzz-guest-{os.getpid()}", "--quiet"]
    if not Path("/run/systemd/system").exists():
        flags += ["--register=no", "--keep-unit"]
    for host_path, guest_path in binds:
        flags.append(f"--bind-ro={host_path}:{guest_path}")
    env = {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
    log = open(work / "console.log", "wb")
    process = subprocess.Popen([NSPAWN, *flags], stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, env=env, start_new_session=True)
    guest: Guest | None = None
    try:
        leader = _pid1_of(process.pid, time.monotonic() + 30)
        guest = Guest(root, process, leader)
        deadline = time.monotonic() + 120
        while True:
            state = guest.run(["systemctl", "is-system-running", "--wait"], check=False,
                              timeout=120).stdout.strip()
            if state in ("running", "degraded"):
                break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"guest did not boot (state {state!r}); see console.log")
            time.sleep(0.5)
        yield guest
    finally:
        if guest is not None and process.poll() is None:
            guest.run(["systemctl", "poweroff"], check=False, timeout=30)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":  # `python -m tests.nspawn.guest`: build the cached image only
    reason = cannot_boot()
    print(reason or base_image())
