"""The custodian's own integers are range-checked at load: a value outside is a
ConfigError naming the key (`custodian FILE` prints it as one line and exits 1), before
the token is opened."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyrage
import pytest

from custody import TokenConfig
from custody.custodian.config import MAX_RECIPIENTS, ConfigError, load
from custody.custodian.messages import MAX_FRAME
from custody.custodian.messages import MAX_RECORDS
from tests.fixtures.custodian import write_custodian_config


def _config(tmp_path: Path, line: str) -> Path:
    path = write_custodian_config(tmp_path / "c.toml", token=TokenConfig("m", "t", None),
                                  state_dir=tmp_path, socket=tmp_path / "s", relay_url="wss://r")
    text = re.sub(r"signatures_per_minute = \d+\n", "", path.read_text())
    path.write_text(text.replace("[pkcs11]\n", f"{line}\n[pkcs11]\n"))
    return path


@pytest.mark.token_independent
@pytest.mark.parametrize("line, fault", [
    ("signatures_per_minute = 0", "signatures_per_minute must be 1 to 1000000, not 0"),
    ("signatures_per_minute = -5", "signatures_per_minute must be 1 to 1000000, not -5"),
    ("signatures_per_minute = 1000001",
     "signatures_per_minute must be 1 to 1000000, not 1000001"),
    ("destroy_grace_seconds = -1", "destroy_grace_seconds must be 0 to 31622400, not -1"),
    ("destroy_grace_seconds = 31622401",
     "destroy_grace_seconds must be 0 to 31622400, not 31622401"),
    ("max_records = 0", f"max_records must be 1 to {MAX_RECORDS}, not 0"),
    (f"max_records = {MAX_RECORDS + 1}",
     f"max_records must be 1 to {MAX_RECORDS}, not {MAX_RECORDS + 1}"),
    ("log_max_bytes = 4095", "log_max_bytes must be 4096 to 1099511627776, not 4095"),
    (f"max_inflight_bytes = {MAX_FRAME - 1}",  # a largest frame would never be read
     f"max_inflight_bytes must be {MAX_FRAME} to 1099511627776, not {MAX_FRAME - 1}"),
])
def test_a_value_out_of_range_is_a_config_error_naming_the_key(
        tmp_path: Path, line: str, fault: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"[custodian] {fault}")):
        load(str(_config(tmp_path, line)))


@pytest.mark.token_independent
@pytest.mark.parametrize("line", ["signatures_per_minute = 1", "signatures_per_minute = 1000000",
                                  "destroy_grace_seconds = 0",
                                  "destroy_grace_seconds = 31622400", "max_records = 1",
                                  f"max_records = {MAX_RECORDS}", "log_max_bytes = 4096",
                                  f"max_inflight_bytes = {MAX_FRAME}"])
def test_the_bounds_themselves_load(tmp_path: Path, line: str) -> None:
    key, value = line.split(" = ")
    settings = load(str(_config(tmp_path, line))).settings
    assert getattr(settings, key) == int(value)


@pytest.mark.token_independent
@pytest.mark.parametrize("line, fault", [
    ("pipeline_uid = -1", "[custodian] pipeline_uid must be 0 to 4294967294, not -1"),
    ("pipeline_uid = 4294967295",  # (uid_t) -1: "no uid" to the kernel
     "[custodian] pipeline_uid must be 0 to 4294967294, not 4294967295"),
    (f"pipeline_uid = {10**20}", "[custodian] pipeline_uid must be 0 to 4294967294"),
    ("[pkcs11]\nunsealed_cache_seconds = inf", "[pkcs11] unsealed_cache_seconds must be above 0"),
    ("[pkcs11]\nunsealed_cache_seconds = nan", "[pkcs11] unsealed_cache_seconds must be above 0"),
    ("[pkcs11]\nunsealed_cache_seconds = 0", "[pkcs11] unsealed_cache_seconds must be above 0"),
    ("[pkcs11]\nunsealed_cache_seconds = 3600.5",
     "[pkcs11] unsealed_cache_seconds must be above 0 and at most 3600"),
])
def test_the_daemons_uid_and_cache_rules_hold_here_too(
        tmp_path: Path, line: str, fault: str) -> None:
    path = _config(tmp_path, "")
    table, _, member = line.rpartition("\n")
    text = path.read_text()
    path.write_text(text.replace("[pkcs11]\n", f"[pkcs11]\n{member}\n") if table
                    else text.replace("[pkcs11]\n", f"{member}\n[pkcs11]\n"))
    with pytest.raises(ConfigError, match=re.escape(fault)):
        load(str(path))


@pytest.mark.token_independent
@pytest.mark.parametrize("label", ["", "a\tb", "é", "k" * 256])
def test_a_kek_label_no_blob_could_name_is_refused_at_load(tmp_path: Path, label: str) -> None:
    """As custody refuses it at the token (custody/_records.py `kek_label_ok`): "" once made
    `keys rotate` label its new KEK '-xxxxxxxx'."""
    path = _config(tmp_path, "")
    path.write_text(path.read_text().replace('kek_label = "buzz-broker-kek"',
                                             f"kek_label = {json.dumps(label)}"))
    with pytest.raises(ConfigError, match=re.escape("[pkcs11] kek_label must be 1 to 255")):
        load(str(path))


@pytest.mark.token_independent
def test_uid_bounds_and_a_relative_pin_file_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pin_file is resolved against FILE's directory as every other custodian path (and
    the daemon's pin_file), not against the working directory."""
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for uid in (0, 4294967294):
        path = _config(tmp_path, f"pipeline_uid = {uid}")
        assert load(str(path)).settings.pipeline_uid == uid
    path.write_text(path.read_text().replace('pin_file = ""', 'pin_file = "pins/token-pin"'))
    assert load(str(path)).token.pin_file == str(tmp_path / "pins" / "token-pin")


@pytest.mark.token_independent
def test_a_relative_module_path_is_resolved_against_the_files_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `module` holding a slash is a path, resolved against FILE's directory as every
    other custodian path (config.py docstring); a bare name is left to dlopen's search."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = _config(tmp_path, "")
    text = path.read_text()
    path.write_text(re.sub(r'module = "[^"]*"', 'module = "lib/libsofthsm2.so"', text))
    assert load(str(path)).token.module == str(tmp_path / "lib" / "libsofthsm2.so")
    path.write_text(re.sub(r'module = "[^"]*"', 'module = "libsofthsm2.so"', text))
    assert load(str(path)).token.module == "libsofthsm2.so"


@pytest.mark.token_independent
@pytest.mark.parametrize("table, key", [("custodian", "relay_url"), ("custodian", "socket"),
                                        ("custodian", "state_dir"), ("pkcs11", "module"),
                                        ("pkcs11", "token_label")])
def test_a_required_key_left_out_is_a_config_error_naming_it(
        tmp_path: Path, table: str, key: str) -> None:
    path = _config(tmp_path, "")
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()
                            if not line.startswith(f"{key} = ")))
    with pytest.raises(ConfigError, match=re.escape(f"[{table}] {key} is required")):
        load(str(path))


@pytest.mark.token_independent
@pytest.mark.parametrize("name", ["custodian", "pkcs11", "backup"])
def test_a_known_table_name_given_a_value_is_a_config_error(tmp_path: Path, name: str) -> None:
    """`custodian = 1` (a value where the table goes) is one line naming it, not a
    traceback from reading it as a table."""
    path = _config(tmp_path, "")
    path.write_text(f"{name} = 1\n" + _without_table(path.read_text(), name))
    with pytest.raises(ConfigError, match=re.escape(f"unknown table [{name}]")):
        load(str(path))


def _without_table(text: str, name: str) -> str:
    out, skipping = [], False
    for line in text.splitlines():
        if line.startswith("["):
            skipping = line == f"[{name}]"
        if not skipping:
            out.append(line + "\n")
    return "".join(out)


@pytest.mark.token_independent
def test_a_socket_path_one_byte_past_sockaddr_un_is_refused_at_load(tmp_path: Path) -> None:
    """107 bytes and a NUL is all sun_path holds: 108 is refused here, before the token."""
    for size, loads in ((107, True), (108, False)):
        socket = tmp_path / ("s" * (size - len(os.fsencode(tmp_path / "s")) + 1))
        assert len(os.fsencode(socket)) == size
        path = write_custodian_config(tmp_path / "c.toml", token=TokenConfig("m", "t", None),
                                      state_dir=tmp_path, socket=socket, relay_url="wss://r")
        if loads:
            assert load(str(path)).settings.socket == socket
        else:
            with pytest.raises(ConfigError, match="longer than 107 bytes"):
                load(str(path))


@pytest.mark.token_independent
def test_at_most_max_recipients_recipients(tmp_path: Path) -> None:
    many = [str(pyrage.x25519.Identity.generate().to_public())
            for _ in range(MAX_RECIPIENTS + 1)]
    for count, loads in ((MAX_RECIPIENTS, True), (MAX_RECIPIENTS + 1, False)):
        path = _config(tmp_path, "")
        path.write_text(path.read_text() + "[backup]\nrecipients = "
                        + json.dumps(many[:count]) + '\ndir = "b"\n')
        if loads:
            assert len(load(str(path)).settings.backup_recipients) == count
        else:
            with pytest.raises(ConfigError, match=f"1 to {MAX_RECIPIENTS} recipients"):
                load(str(path))


@pytest.mark.token_independent
def test_a_relative_backup_dir_is_resolved_against_the_files_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As every relative path of the file (the docstring's list names [backup] dir), never
    against the working directory."""
    recipient = str(pyrage.x25519.Identity.generate().to_public())
    (tmp_path / "etc").mkdir()
    path = _config(tmp_path / "etc", "")
    path.write_text(path.read_text() + f'[backup]\nrecipients = ["{recipient}"]\n'
                    'dir = "backups"\n')
    monkeypatch.chdir(tmp_path)
    assert load(str(path)).settings.backup_dir == tmp_path / "etc" / "backups"
