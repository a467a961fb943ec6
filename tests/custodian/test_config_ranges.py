"""The custodian's own integers are range-checked at load: a value outside is a
ConfigError naming the key (`custodian FILE` prints it as one line and exits 1), before
the token is opened."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from custody import TokenConfig
from custody.custodian.config import ConfigError, load
from custody.custodian.messages import MAX_FRAME
from custody.custodian.server import MAX_RECORDS
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
