"""`keys rotate` and `keys migrate` (issue 18 items 2 and 3; custody/_rotation.py).

In-process: every agent resealed under a new KEK and still signing as itself, the old
KEK destroyed, the daemon's lock honoured both ways, a blob that does not open stopping
the run before anything changes.

Crash points: the real CLI code path (`tests.custody.crashing_rotation`) is SIGKILLed at
each named step of a rotation and of a migration (SoftHSM token -> a second SoftHSM
token). After each kill, every agent signs (verified) with the configuration that names
where the keystore says the keys are: the source before the swap commits, the target
from then on; then the ordinary CLI run finishes the job, and afterwards every agent
signs, the old KEK is gone from its token and no plan, retiring record or staged blob
is left behind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import custody._kekinit as kekinit_module
import custody._token as token_module
from custody import (
    ROTATION_CHECKPOINTS,
    Custody,
    CustodyError,
    TokenConfig,
    UnsealFailed,
    init_kek,
    rotate_keys,
    verify_event,
)
from custody._statelock import StateLock
from tests.custody._sealing import HUMAN, SEAL_KINDS, blob_of, config_for, event, put_blob
from tests.custody._secrets import PUB_1, PUB_2, SECRET_1, SECRET_2, SECRET_X
from tests.fixtures.broker import write_config
from tests.fixtures.token import REPO, SoftHsmToken, in_session, make_token

BUZZ_BROKER = REPO / ".venv" / "bin" / "buzz-broker"
SECOND_TOKEN = "buzz-test-2"
SECRETS = (SECRET_1, SECRET_2, SECRET_X)
SIGKILLED = -9
ANY_KEK_TYPE = (*token_module.AES_KEY_TYPES, *token_module.MAC_KEY_TYPES)


async def _labels_present(config: TokenConfig, *labels: str) -> set[str]:
    def find(session: Any) -> set[str]:
        return {label for label in labels
                if token_module._find_key(session, config.token_label, label, ANY_KEK_TYPE)}

    return await in_session(config, find)


async def _populate(config: TokenConfig, state: Path) -> list[str]:
    await init_kek(config)
    opened = await Custody.open(config, state)
    try:
        return [(await opened.import_agent(bytearray(s.encode()), owner=HUMAN)).pubkey
                for s in SECRETS]
    finally:
        await opened.aclose()


def _meta(state: Path, *, staged_empty: bool = True) -> dict[str, str]:
    db = sqlite3.connect(state / "keystore.db")
    try:
        if staged_empty:
            assert db.execute("SELECT count(*) FROM reseal").fetchone()[0] == 0
        return dict(db.execute("SELECT name, value FROM custody_meta").fetchall())
    finally:
        db.close()


@pytest.mark.token_offers("GENERATE_KEY")  # rotation without --new-kek-label makes one
@pytest.mark.parametrize("kind", SEAL_KINDS)
async def test_rotate_reseals_every_agent_and_destroys_the_old_kek(
    softhsm_token: SoftHsmToken, tmp_path: Path, kind: str
) -> None:
    config = config_for(softhsm_token, kind, f"rot-{kind}-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    agents = await _populate(config, state)
    before = {agent: blob_of(state, agent) for agent in agents}
    report = await rotate_keys(config, state)
    assert (report.agents, report.outcome, report.seal) == (3, "rotated", kind)
    assert report.old.kek_label == config.kek_label and report.new.kek_label != config.kek_label
    halves = (config.kek_label, config.kek_label + "-mac")
    assert report.destroyed == (halves if kind == "etm" else halves[:1])
    assert await _labels_present(config, *halves) == set()
    assert _meta(state) == {"active_token": config.token_label,
                            "active_kek": report.new.kek_label}
    opened = await Custody.open(config, state)
    try:
        for agent in agents:
            blob = blob_of(state, agent)
            assert blob != before[agent]
            assert blob[3:3 + blob[2]].decode() == report.new.kek_label  # names its KEK
            assert (await opened.sign_event(agent, event(agent))).pubkey == agent
        minted = await opened.mint_agent(owner=HUMAN,
                                         mint_ref=None)  # new blobs go under the new KEK
        assert blob_of(state, minted.pubkey)[3:3 + blob_of(state, minted.pubkey)[2]].decode() \
            == report.new.kek_label
    finally:
        await opened.aclose()


@pytest.mark.token_offers("GENERATE_KEY")  # the new label's KEK is made by the rotation
@pytest.mark.parametrize("kind", SEAL_KINDS)
async def test_rotating_to_the_old_keks_mac_label_keeps_the_new_kek(
    softhsm_token: SoftHsmToken, tmp_path: Path, kind: str
) -> None:
    # `K-mac` names the old encrypt-then-MAC KEK's HMAC half and may name a new AES KEK too:
    # destroying K once destroyed the new active KEK (gcm: every key lost), and etm found
    # twins under `K-mac` and stopped opening. Only the key types a half has are its own.
    config = config_for(softhsm_token, kind, f"rm-{kind}-{tmp_path.name}"[:40])
    state = tmp_path / "state"
    agents = await _populate(config, state)
    report = await rotate_keys(config, state, new_kek_label=config.kek_label + "-mac")
    assert (report.outcome, report.new.kek_label) == ("rotated", config.kek_label + "-mac")
    assert report.destroyed == ((config.kek_label, config.kek_label + "-mac") if kind == "etm"
                                else (config.kek_label,))
    assert _meta(state)["active_kek"] == config.kek_label + "-mac"
    opened = await Custody.open(dataclasses.replace(config, kek_label=report.new.kek_label),
                                state)
    try:
        for agent in agents:
            assert (await opened.sign_event(agent, event(agent))).pubkey == agent
    finally:
        await opened.aclose()


@pytest.mark.token_offers("GENERATE_KEY")  # rotation without --new-kek-label makes one
async def test_rotate_refuses_while_custody_is_open_and_custody_refuses_while_it_runs(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    config = softhsm_token.config(kek_label=f"lock-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    await _populate(config, state)
    opened = await Custody.open(config, state)  # the daemon, as far as the lock can tell
    try:
        with pytest.raises(CustodyError, match="in use .*stop the daemon"):
            await rotate_keys(config, state)
    finally:
        await opened.aclose()
    held = StateLock.exclusive(state)  # a rotation, as far as the daemon can tell
    try:
        with pytest.raises(CustodyError, match="rotation or migration is running"):
            await Custody.open(config, state)
    finally:
        held.release()
    assert (await rotate_keys(config, state)).agents == 3


@pytest.mark.token_offers("GENERATE_KEY")  # rotation without --new-kek-label makes one
async def test_a_blob_that_does_not_open_stops_the_rotation_before_anything_changes(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    config = softhsm_token.config(kek_label=f"stop-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    agents = await _populate(config, state)
    put_blob(state, PUB_2, blob_of(state, PUB_1))  # a swapped blob: it opens for nobody
    before = {agent: blob_of(state, agent) for agent in agents}
    with pytest.raises(UnsealFailed, match=PUB_2):
        await rotate_keys(config, state)
    assert {agent: blob_of(state, agent) for agent in agents} == before
    assert await _labels_present(config, config.kek_label) == {config.kek_label}
    planned = _meta(state, staged_empty=False)["rotation_target_kek"]
    # The operator removes the broken agent; the next run uses the planned KEK (no orphan).
    opened = await Custody.open(config, state)
    await opened.destroy_agent(PUB_2)
    await opened.aclose()
    report = await rotate_keys(config, state)
    assert report.new.kek_label == planned and report.agents == 2


async def token_objects(config: TokenConfig) -> list[str]:
    """Every object's label in `config`'s token, sorted (twins listed twice)."""
    def listing(session: Any) -> list[str]:
        return sorted(str(o[token_module.Attribute.LABEL]) for o in session.get_objects())

    return await in_session(config, listing)


def keystore_meta(state: Path) -> dict[str, str]:
    """custody_meta as it stands, read-only."""
    db = sqlite3.connect(f"file:{state / 'keystore.db'}?mode=ro", uri=True)
    try:
        return dict(db.execute("SELECT name, value FROM custody_meta").fetchall())
    finally:
        db.close()


@pytest.mark.token_offers("GENERATE_KEY")  # the old code made the new KEK before refusing
async def test_a_mistyped_kek_label_refuses_the_rotation_and_changes_nothing(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    """`keys rotate` with a [pkcs11] kek_label naming no KEK: one line, exit 1, and the
    token's objects and custody_meta exactly as before. The old code recorded a plan and
    made `TYPO-xxxxxxxx` first, and its remedy (`keys init`) would make an empty KEK."""
    config = softhsm_token.config(kek_label=f"typo-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    agents = await _populate(config, state)
    typo = dataclasses.replace(config, kek_label=config.kek_label + "x")
    path = write_config(tmp_path / "typo.toml", token=typo, state_dir=state,
                        socket=tmp_path / "unused.sock", relay_url="ws://127.0.0.1:1")
    objects, meta = await token_objects(config), keystore_meta(state)
    refused = _cli(path, "rotate")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert await token_objects(config) == objects
    assert keystore_meta(state) == meta
    assert f"no KEK labelled {typo.kek_label!r} to rotate from" in refused.stderr
    assert "keys init" not in refused.stderr
    assert await _check_here(config, state) == dict.fromkeys(agents, True)


# --- crash points -------------------------------------------------------------------------

def _run(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "tests.custody.crashing_rotation", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ))
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _check(config: Path) -> dict[str, bool]:
    """Every agent signs (verified) with `config`: in a new process, which sees a token made
    after this one's C_Initialize (the migration target)."""
    done = _run("check", str(config))
    assert done.returncode == 0, done.stderr
    result: dict[str, bool] = json.loads(done.stdout)
    return result


async def _check_here(config: TokenConfig, state: Path) -> dict[str, bool]:
    """`_check` in this process, for the session's own token (cheaper than a process)."""
    opened = await Custody.open(config, state)
    try:
        result = {}
        for record in opened.agents():
            signed = await opened.sign_event(record.pubkey, event(record.pubkey))
            result[record.pubkey] = verify_event(signed.to_json_obj())
        return result
    finally:
        await opened.aclose()


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(BUZZ_BROKER), "--config", str(config), "keys", *args],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert "Traceback" not in done.stderr, done.stderr
    return done


@pytest.fixture(scope="module")
def second_token(softhsm_token: SoftHsmToken) -> str:
    """A second token in the session's SoftHSM (same PIN files): the migration target."""
    if softhsm_token.kind != "softhsm":
        pytest.skip(f"the migration target is a second token beside the session's; the "
                    f"{softhsm_token.kind} run has one token")
    make_token(softhsm_token.directory, SECOND_TOKEN)
    return SECOND_TOKEN


@pytest.mark.token_offers("GENERATE_KEY")  # rotation without --new-kek-label makes one
@pytest.mark.parametrize("operation", ["rotate", "migrate"])
@pytest.mark.parametrize("step", ROTATION_CHECKPOINTS)
async def test_a_kill_at_each_step_leaves_every_agent_usable_and_a_rerun_finishes(
    softhsm_token: SoftHsmToken, second_token: str, tmp_path: Path, operation: str, step: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    label = f"crash-{operation}-{step}-{tmp_path.name}"[:50]
    source = dataclasses.replace(softhsm_token.config(kek_label=label), seal="etm")
    target = dataclasses.replace(source, token_label=second_token, seal="auto")
    state = tmp_path / "state"
    agents = await _populate(source, state)
    paths = {}
    for name, token in (("source", source), ("target", target)):
        paths[name] = write_config(tmp_path / f"{name}.toml", token=token, state_dir=state,
                                   socket=tmp_path / "unused.sock",
                                   relay_url="ws://127.0.0.1:1")
    _append_seal(paths["source"], "etm")
    to = ["migrate", str(paths["target"])] if operation == "migrate" else ["rotate"]
    cli = ["migrate", "--to-config", str(paths["target"])] if operation == "migrate" else ["rotate"]

    done = _run("kill", str(paths["source"]), step, *to)
    assert done.returncode == SIGKILLED, done.stderr
    assert f"crashing_rotation.kill step={step}" in done.stderr

    swapped = ROTATION_CHECKPOINTS.index(step) >= ROTATION_CHECKPOINTS.index("swapped")
    every = {agent: True for agent in agents}
    if not (operation == "migrate" and swapped):  # (the target is checked in a process)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="buzz_broker.custody"):
            await (await Custody.open(source, state)).aclose()
        # The daemon opens fine and tells the operator what the rerun will finish.
        assert "an interrupted `keys rotate`/`keys migrate`" in caplog.text
    if operation == "migrate" and swapped:
        assert _check(paths["target"]) == every  # every agent, as itself
        with pytest.raises(CustodyError, match="point \\[pkcs11\\] at that token"):
            await Custody.open(source, state)  # the old token's configuration, refused
    else:
        assert await _check_here(source, state) == every

    planned = _meta(state, staged_empty=False).get("rotation_target_kek")
    finished = _cli(paths["source"], *cli)
    assert finished.returncode == 0, finished.stderr
    if operation == "migrate":
        assert _check(paths["target"]) == every
    else:
        assert await _check_here(source, state) == every
    meta = _meta(state)
    assert set(meta) == {"active_token", "active_kek"}
    assert await _labels_present(source, label, label + "-mac") == set()
    if operation == "rotate":
        assert meta["active_token"] == source.token_label and meta["active_kek"] != label
        if not swapped:  # the rerun used the KEK the killed run had planned (no orphan)
            assert planned is not None and meta["active_kek"] == planned
        assert await _labels_present(source, meta["active_kek"]) == {meta["active_kek"]}
    else:
        assert meta == {"active_token": second_token, "active_kek": label}


@pytest.mark.token_offers("GENERATE_KEY")
@pytest.mark.parametrize("operation", ["rotate", "migrate"])
async def test_a_key_sealed_under_the_retiring_kek_after_the_swap_survives_the_rerun(
    softhsm_token: SoftHsmToken, second_token: str, tmp_path: Path, operation: str
) -> None:
    """A run killed after its swap leaves the old KEK to destroy. If, before the rerun, a
    key is sealed under that KEK again (a `--recover` did so before it resealed; here the
    agent's blob from before the swap, put back), the rerun seals it under the active KEK
    before destroying the old one: on the old code that agent's key was lost."""
    label = f"late-{operation}-{tmp_path.name}"[:50]
    source = softhsm_token.config(kek_label=label)
    target = dataclasses.replace(source, token_label=second_token)
    state = tmp_path / "state"
    agents = await _populate(source, state)
    paths = {name: write_config(tmp_path / f"{name}.toml", token=token, state_dir=state,
                                socket=tmp_path / "unused.sock", relay_url="ws://127.0.0.1:1")
             for name, token in (("source", source), ("target", target))}
    to = ["migrate", str(paths["target"])] if operation == "migrate" else ["rotate"]
    cli = ["migrate", "--to-config", str(paths["target"])] if operation == "migrate" else ["rotate"]
    before = blob_of(state, agents[0])

    assert _run("kill", str(paths["source"]), "swapped", *to).returncode == SIGKILLED
    assert "retiring_kek" in _meta(state)
    put_blob(state, agents[0], before)  # sealed under the KEK the rerun destroys
    finished = _cli(paths["source"], *cli)
    assert finished.returncode == 0, finished.stderr

    every = {agent: True for agent in agents}
    if operation == "migrate":
        assert _check(paths["target"]) == every
    else:
        assert await _check_here(source, state) == every
    assert await _labels_present(source, label, label + "-mac") == set()
    assert blob_of(state, agents[0]) != before


def _append_seal(path: Path, seal: str) -> None:
    text = path.read_text().replace("[pkcs11]\n", f'[pkcs11]\nseal = "{seal}"\n', 1)
    path.write_text(text)


@pytest.mark.token_offers("GENERATE_KEY")  # rotation without --new-kek-label makes one
async def test_a_resealed_blob_that_does_not_open_is_caught_before_the_swap(
    softhsm_token: SoftHsmToken, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verify step: a target token that sealed one agent wrongly (here: under another
    agent's AAD) is caught by opening every staged blob again; nothing is swapped and the
    old KEK stays."""
    import custody._rotation as rotation_module

    config = softhsm_token.config(kek_label=f"verify-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    agents = await _populate(config, state)
    before = {agent: blob_of(state, agent) for agent in agents}
    honest = rotation_module.seal

    def faulty(token: token_module.Token, secret: object, agent: str) -> bytes:
        return honest(token, secret, PUB_1 if agent == PUB_2 else agent)  # type: ignore[arg-type]

    monkeypatch.setattr(rotation_module, "seal", faulty)
    with pytest.raises(UnsealFailed, match=PUB_2):
        await rotate_keys(config, state)
    assert {agent: blob_of(state, agent) for agent in agents} == before
    assert await _labels_present(config, config.kek_label) == {config.kek_label}
    assert "active_kek" not in _meta(state, staged_empty=False)


async def test_a_token_that_cannot_generate_needs_operator_made_keys_and_says_so(
    softhsm_token: SoftHsmToken, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a TPM: no C_GenerateKey. Rotation without a label is refused before anything is
    recorded; with the label of a pair the operator made, it runs; a label named by the
    operator replaces an interrupted run's plan."""
    config = softhsm_token.config(kek_label=f"nogen-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    agents = await _populate(config, state)
    made = f"{config.kek_label}-made"
    await init_kek(softhsm_token.config(kek_label=made))  # "tpm2_ptool addkey" (real on a TPM)
    monkeypatch.setattr(kekinit_module, "_can_generate", lambda session: False)
    with pytest.raises(CustodyError, match="cannot generate keys.*--new-kek-label"):
        await rotate_keys(config, state)
    assert "rotation_target_kek" not in _meta(state)
    db = sqlite3.connect(state / "keystore.db", isolation_level=None)  # an interrupted plan
    db.execute("INSERT INTO custody_meta VALUES ('rotation_target_token', ?),"
               " ('rotation_target_kek', 'never-made')", (config.token_label,))
    db.close()
    report = await rotate_keys(config, state, new_kek_label=made)
    assert report.new.kek_label == made and report.agents == len(agents)
    assert _meta(state) == {"active_token": config.token_label, "active_kek": made}


@pytest.mark.token_offers("GENERATE_KEY")  # the migration makes the KEK in the target
async def test_check_config_deep_after_keys_migrate_names_the_token_holding_the_keys(
    softhsm_token: SoftHsmToken, second_token: str, local_relay: str, tmp_path: Path
) -> None:
    """After `keys migrate`, `check-config --deep` (daemon/cli/_probe.py) with the old
    token's configuration fails saying to point [pkcs11] at the token the keystore records,
    as `Custody.open` does; with the target's configuration it checks the recorded KEK."""
    label = f"probe-mig-{tmp_path.name}"[:50]
    source = softhsm_token.config(kek_label=label)
    target = dataclasses.replace(source, token_label=second_token)
    state = tmp_path / "state"
    await _populate(source, state)
    paths = {name: write_config(tmp_path / f"{name}.toml", token=token, state_dir=state,
                                socket=tmp_path / "unused.sock", relay_url=local_relay)
             for name, token in (("source", source), ("target", target))}
    moved = _cli(paths["source"], "migrate", "--to-config", str(paths["target"]))
    assert moved.returncode == 0, moved.stderr

    def deep(config: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BUZZ_BROKER), "--config", str(config), "check-config",
                               "--deep"], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ))

    old = deep(paths["source"])
    assert old.returncode == 1 and old.stderr == (
        f"buzz-broker: check-config --deep: token: the agents' keys are sealed in token "
        f"{second_token!r} (moved by `keys migrate`), not {source.token_label!r}: point "
        "[pkcs11] at that token\n"), old.stderr
    new = deep(paths["target"])
    assert new.returncode == 0, new.stdout + new.stderr
    assert (f"token: logged in to {second_token!r} (PIN from [pkcs11] pin_file); KEK "
            f"{label!r} found and checked\n") in new.stdout
