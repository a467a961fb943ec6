"""`check-config --deep` against a real SoftHSM token and LocalRelay: a good setup, broken ones.

Each run is a subprocess (`python -m daemon.cli`), as an operator runs it: the token's
process-wide login state stays out of the test process. The PIN comes from a systemd-style
``$CREDENTIALS_DIRECTORY/token-pin`` in the good case, which is also how the daemon is
proven to read it there (no pin_file in the config at all).
"""

from __future__ import annotations

import grp
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from custody import TokenConfig
from daemon.cli._probe import _why
from tests.fixtures.broker import write_config
from tests.fixtures.relay import free_port
from tests.fixtures.token import SoftHsmToken

REPO = Path(__file__).resolve().parent.parent


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("BUZZ_BROKER_CONFIG", "CREDENTIALS_DIRECTORY")}
    return subprocess.run([sys.executable, "-m", "daemon.cli", *argv], cwd=REPO,
                          env={**base, **(env or {})}, capture_output=True, text=True, timeout=60)


def _credentials(tmp_path: Path, pin_source: str) -> Path:
    """A systemd-like credentials directory holding token-pin (0400), as LoadCredential= makes."""
    directory = tmp_path / "credentials"
    directory.mkdir()
    shutil.copyfile(pin_source, directory / "token-pin")
    os.chmod(directory / "token-pin", 0o400)
    return directory


def _config(tmp_path: Path, token: TokenConfig, relay_url: str, **pkcs11: object) -> Path:
    no_pin = TokenConfig(module=token.module, token_label=token.token_label, pin_file=None,
                         kek_label=token.kek_label)
    return write_config(tmp_path / "broker.toml", token=no_pin, state_dir=tmp_path / "state",
                        socket=tmp_path / "b.sock", relay_url=relay_url,
                        sections={"pkcs11": pkcs11} if pkcs11 else None)


def test_deep_good_setup_with_the_pin_as_a_systemd_credential(
    custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
    softhsm_token: SoftHsmToken,
) -> None:
    token, _state = custody_state
    path = _config(tmp_path, token, local_relay)
    credentials = _credentials(tmp_path, softhsm_token.pin_file)
    done = _run("check-config", "--deep", env={"BUZZ_BROKER_CONFIG": str(path),
                                               "CREDENTIALS_DIRECTORY": str(credentials)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"config: {path} ($BUZZ_BROKER_CONFIG)"
    assert lines[1] == f"pin: {credentials / 'token-pin'} (systemd credential)"
    assert lines[2].startswith(f"token: logged in to {token.token_label!r} (PIN from systemd "
                               f"credential); KEK {token.kek_label!r} found and checked")
    assert lines[3].startswith(f"relay: {local_relay}: WebSocket opened in ")
    assert lines[4] == f"state: {tmp_path / 'state'} does not exist yet: serve makes it (0700)"
    assert lines[5:] == ["ok"] and done.stderr == ""
    pin = Path(softhsm_token.pin_file).read_text().strip()
    assert pin not in done.stdout + done.stderr


def test_deep_without_a_pin_names_where_it_looked(
    custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path
) -> None:
    token, _state = custody_state
    path = _config(tmp_path, token, local_relay)
    shallow = _run("--config", str(path), "check-config")
    assert shallow.returncode == 0 and shallow.stdout.splitlines()[1].startswith("pin: none here")
    deep = _run("--config", str(path), "check-config", "--deep")
    assert deep.returncode == 1 and deep.stdout.endswith("(--config)\n" + shallow.stdout.splitlines()[1] + "\n")
    assert deep.stderr.count("\n") == 1
    assert deep.stderr.startswith("buzz-broker: check-config --deep: token: no token PIN")


def test_a_path_given_to_check_config_is_named_as_such(
    custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path
) -> None:
    token, _state = custody_state
    path = _config(tmp_path, token, local_relay)
    done = _run("check-config", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"config: {path} (check-config PATH)"
    given = _run("--config", str(path), "check-config")
    assert given.stdout.splitlines()[0] == f"config: {path} (--config)"


def test_deep_broken_kek_and_broken_relay_each_named(
    custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
    softhsm_token: SoftHsmToken,
) -> None:
    token, _state = custody_state
    credentials = _credentials(tmp_path, softhsm_token.pin_file)
    env = {"CREDENTIALS_DIRECTORY": str(credentials)}

    no_kek = _config(tmp_path, token, local_relay, kek_label="never-made-kek")
    done = _run("--config", str(no_kek), "check-config", "--deep", env=env)
    assert done.returncode == 1 and "ok" not in done.stdout.splitlines()
    assert done.stderr.startswith("buzz-broker: check-config --deep: token: ")
    assert "never-made-kek" in done.stderr and done.stderr.count("\n") == 1

    dead_relay = f"ws://127.0.0.1:{free_port()}"
    unreachable = _config(tmp_path, token, dead_relay)
    done = _run("--config", str(unreachable), "check-config", "--deep", env=env)
    assert done.returncode == 1
    assert done.stdout.splitlines()[2].startswith("token: logged in")  # the token step passed
    # The errno's text, which trio keeps under a group of one error per address tried (it
    # was "cannot connect (OSError)": a review).
    assert done.stderr == (f"buzz-broker: check-config --deep: relay: {dead_relay}: "
                           "cannot connect (Connection refused)\n"), done.stderr

    wrong_pin = tmp_path / "wrong"
    wrong_pin.mkdir()
    (wrong_pin / "token-pin").write_text("not-the-pin-0000\n")
    os.chmod(wrong_pin / "token-pin", 0o400)
    done = _run("--config", str(no_kek), "check-config", "--deep",
                env={"CREDENTIALS_DIRECTORY": str(wrong_pin)})
    assert done.returncode == 1 and "token: " in done.stderr
    assert "not-the-pin-0000" not in done.stdout + done.stderr
    for result in (done,):
        assert "Traceback" not in result.stderr


@pytest.mark.token_offers("GENERATE_KEY")  # keys rotate without --new-kek-label makes one
def test_deep_says_what_a_group_that_does_not_exist_does(
    custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
    softhsm_token: SoftHsmToken,
) -> None:
    """Each group `[server]` names is looked up as `serve` will. One that does not exist is
    said, with what it does, and passes: a socket group stops a `serve` that binds its own
    socket but is not read under socket activation (the installed layout), which only the
    start knows; a TCP group admits its members once it is made."""
    token, _state = custody_state
    env = {"CREDENTIALS_DIRECTORY": str(_credentials(tmp_path, softhsm_token.pin_file))}
    missing = "bb-no-such-group"
    assert all(g.gr_name != missing for g in grp.getgrall())
    root_group = grp.getgrgid(0).gr_name

    def config(name: str, server: dict[str, object]) -> Path:
        no_pin = TokenConfig(module=token.module, token_label=token.token_label,
                             pin_file=None, kek_label=token.kek_label)
        return write_config(tmp_path / name, token=no_pin, state_dir=tmp_path / "state",
                            socket=tmp_path / "b.sock", relay_url=local_relay,
                            sections={"server": server})

    absent = config("absent.toml", {"socket_group": missing})
    done = _run("--config", str(absent), "check-config", "--deep", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [
        f"groups: socket_group {missing!r} does not exist: a serve that binds its own socket "
        "refuses to start (under buzz-broker.socket, SocketGroup= applies and this key is "
        "not read)", "ok"]

    present = config("present.toml", {"socket_group": root_group,
                                      "tcp_allow_groups": [missing, "0"]})
    done = _run("--config", str(present), "check-config", "--deep", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [
        f"groups: socket_group {root_group!r} is gid 0; tcp_allow_groups '0' is gid 0; "
        f"tcp_allow_groups {missing!r} does not exist: admits nobody until it does", "ok"]


def test_serve_binding_its_own_socket_refuses_a_socket_group_that_does_not_exist(
    tmp_path: Path,
) -> None:
    """What the groups line promises for a `serve` not given its socket by systemd: it
    refuses to start, naming the group (daemon/http.py `bind_unix_socket`)."""
    from daemon.http import ListenError, bind_unix_socket

    with pytest.raises(ListenError, match="socket group 'bb-no-such-group' does not exist"):
        bind_unix_socket(str(tmp_path / "b.sock"), group="bb-no-such-group")
    assert not (tmp_path / "b.sock").exists()


def test_deep_after_keys_rotate_checks_the_kek_the_keystore_records(
    softhsm_token: SoftHsmToken, local_relay: str, tmp_path: Path,
) -> None:
    """`keys rotate` leaves `[pkcs11] kek_label` as it was and records the new KEK in the
    keystore: the deep check logs in and checks that one, as the daemon does, and says so."""
    token = softhsm_token.config(kek_label=f"deep-rot-{tmp_path.name}"[:50])
    path = write_config(tmp_path / "broker.toml", token=token, state_dir=tmp_path / "state",
                        socket=tmp_path / "b.sock", relay_url=local_relay)
    assert _run("--config", str(path), "keys", "init").returncode == 0
    before = _run("--config", str(path), "check-config", "--deep")
    assert before.returncode == 0, before.stderr
    assert f"KEK {token.kek_label!r} found and checked\n" in before.stdout

    rotated = _run("--config", str(path), "keys", "rotate")
    assert rotated.returncode == 0, rotated.stderr
    new = re.search(rf"KEK '({re.escape(token.kek_label)}-[0-9a-f]{{8}})'", rotated.stdout)
    assert new, rotated.stdout

    done = _run("--config", str(path), "check-config", "--deep")
    assert done.returncode == 0, done.stdout + done.stderr
    token_line = next(line for line in done.stdout.splitlines() if line.startswith("token: "))
    assert token_line == (
        f"token: logged in to {token.token_label!r} (PIN from [pkcs11] pin_file); KEK "
        f"{new[1]!r} found and checked (the active KEK the keystore records, not [pkcs11] "
        f"kek_label {token.kek_label!r})")
    assert done.stdout.endswith("\nok\n") and done.stderr == ""


@pytest.mark.token_offers("GENERATE_KEY")  # the custodian's keys rotate makes the new KEK
def test_deep_through_a_custodian_after_its_own_keys_rotate(
    softhsm_token: SoftHsmToken, local_relay: str, tmp_path: Path,
) -> None:
    """With `[custody] custodian_socket` the deep check asks the custodian, which opens
    custody under the KEK the keystore records: after the custodian's own `keys rotate`
    (custodian stopped, then started again) the daemon's check passes."""
    from tests.fixtures.custodian import CustodianProcess, write_custodian_config

    token = softhsm_token.config(kek_label=f"deep-cust-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    socket = tmp_path / "c.sock"
    custodian_config = write_custodian_config(tmp_path / "custodian.toml", token=token,
                                              state_dir=state, socket=socket,
                                              relay_url=local_relay)

    def keys(*words: str) -> subprocess.CompletedProcess[str]:
        base = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
        return subprocess.run([sys.executable, "-m", "custody.custodian", str(custodian_config),
                               "keys", *words], cwd=REPO, env=base, capture_output=True,
                              text=True, timeout=120)

    assert keys("init").returncode == 0
    rotated = keys("rotate")
    assert rotated.returncode == 0, rotated.stderr
    config = tmp_path / "broker.toml"
    config.write_text(f'[server]\nsocket = "{tmp_path / "b.sock"}"\n[state]\ndir = "{state}"\n'
                      f'[custody]\ncustodian_socket = "{socket}"\n'
                      f'[relay]\nurl = "{local_relay}"\n')
    custodian = CustodianProcess(custodian_config, socket)
    custodian.start()  # on the rotated KEK the keystore records
    try:
        done = _run("--config", str(config), "check-config", "--deep")
    finally:
        custodian.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"token: the custodian at {socket} answers" in done.stdout


def test_a_tls_failure_is_said_by_openssl_not_as_a_kernel_errno() -> None:
    """An SSLError's errno is OpenSSL's (1 for most), not the kernel's: "cannot connect
    (Operation not permitted)" would send the operator after permissions, not the
    relay's certificate."""
    exc = ssl.SSLCertVerificationError(
        1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed "
           "certificate (_ssl.c:1006)")
    wrapped = OSError("all attempts to connect to relay.example:443 failed")
    wrapped.__cause__ = exc
    for raised in (exc, wrapped):
        said = _why(raised)
        assert "CERTIFICATE_VERIFY_FAILED" in said, said
        assert os.strerror(1) not in said



def test_a_name_that_does_not_resolve_is_said_by_getaddrinfo_not_as_a_kernel_errno() -> None:
    """A failed lookup's code is getaddrinfo's (EAI_NONAME, -2), not the kernel's: it read
    "cannot connect (Unknown error -2)" for a mistyped relay host (a review of the change
    that read errnos from trio's group of connect errors)."""
    exc = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    wrapped = OSError("all attempts to connect to no-such-host.invalid:443 failed")
    wrapped.__cause__ = exc
    for raised in (exc, wrapped):
        assert _why(raised) == "Name or service not known"
