"""The custodian's units and the daemon's drop-in load in systemd (`systemd-analyze verify`
prints nothing), score no worse than the daemon's unit, and say what docs/custodian.md
says: the PIN is the custodian's only, its socket (bound by PID 1) the pipeline's group's
only, no network. The real-systemd run of both units is
tests/nspawn/test_real_systemd.py::test_the_custodian_step_then_the_first_request_activates_both."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_systemd_units import HOST_UNIT_DIRS, SERVICE, SOCKET, TCP_SOCKET, _directives

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "buzz-custodian.service"
UNIT_SOCKET = REPO / "systemd" / "buzz-custodian.socket"
DROPIN = REPO / "systemd" / "buzz-broker.service.d" / "custodian.conf"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")


def test_the_pin_moves_to_the_custodian_and_the_network_does_not() -> None:
    unit, dropin = _directives(UNIT), _directives(DROPIN)
    assert unit["LoadCredential"] == ["token-pin:/etc/buzz-broker/token-pin"]
    assert dropin["LoadCredential"] == [""] and dropin["UnsetEnvironment"] == ["SOFTHSM2_CONF"]
    # Socket-activated: the daemon needs the socket; a restarting custodian never stops it.
    assert dropin["Requires"] == ["buzz-custodian.socket"]
    assert unit["Requires"] == ["buzz-custodian.socket"]
    assert unit["User"] == ["buzz-custodian"] and unit["Restart"] == ["always"]
    assert unit["RestrictAddressFamilies"] == ["AF_UNIX"] and unit["PrivateNetwork"] == ["yes"]
    # tmpfiles makes its directories: the install's key commands write there first.
    assert "StateDirectory" not in unit
    sock = _directives(UNIT_SOCKET)
    assert sock["ListenStream"] == ["/run/buzz-custodian/custodian.sock"]
    assert (sock["SocketUser"], sock["SocketGroup"], sock["SocketMode"]) == (
        ["buzz-custodian"], ["buzz-broker"], ["0660"])
    tmpfiles = (REPO / "systemd" / "buzz-custodian.tmpfiles").read_text()
    assert "d /run/buzz-custodian 2750 buzz-custodian buzz-broker -" in tmpfiles
    # The keys are the custodian's alone: the pipeline's group gets no grant there.
    assert "d /var/lib/buzz-custodian 0700 buzz-custodian buzz-custodian -" in tmpfiles
    assert "d /var/lib/buzz-custodian/keys 0700 buzz-custodian buzz-custodian -" in tmpfiles
    assert "buzz-broker" not in tmpfiles.split("d /var/lib/buzz-custodian ", 1)[1]
    daemon = _directives(SERVICE)
    for key in ("NoNewPrivileges", "ProtectSystem", "MemoryDenyWriteExecute",
                "SystemCallFilter", "CapabilityBoundingSet", "LimitCORE", "ProtectProc"):
        assert unit[key] == daemon[key], key


@needs_analyze
def test_verify_both_units_prints_nothing(tmp_path: Path) -> None:
    assert ANALYZE is not None
    root = tmp_path / "root"
    host = next(d for d in HOST_UNIT_DIRS if d.is_dir())
    shutil.copytree(host, root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    (etc / "buzz-broker.service.d").mkdir(parents=True)
    for unit in (SERVICE, SOCKET, TCP_SOCKET, UNIT, UNIT_SOCKET):
        shutil.copyfile(unit, etc / unit.name)
    shutil.copyfile(DROPIN, etc / "buzz-broker.service.d" / DROPIN.name)
    for exe in ("opt/buzz-broker/venv/bin/buzz-broker", "bin/sh", "usr/bin/systemd-tmpfiles"):
        target = root / exe
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("#!/bin/sh\nexit 0\n")
        target.chmod(0o755)
    proc = subprocess.run([ANALYZE, "verify", f"--root={root}", SERVICE.name, UNIT.name,
                           UNIT_SOCKET.name],
                          capture_output=True, text=True, timeout=60)
    assert proc.stderr == "" and proc.returncode == 0, proc.stderr


@needs_analyze
def test_the_custodians_exposure_is_no_worse_than_the_daemons() -> None:
    assert ANALYZE is not None
    scores = []
    for unit in (SERVICE, UNIT):
        out = subprocess.run([ANALYZE, "security", "--offline=true", "--no-pager", str(unit)],
                             capture_output=True, text=True, timeout=60).stdout
        line = next(l for l in out.splitlines() if "Overall exposure level" in l)
        scores.append(float(line.split("level for")[1].split(":")[1].split()[0]))
    print(f"\nexposure: daemon {scores[0]}, custodian {scores[1]}")
    assert scores[1] <= scores[0]
