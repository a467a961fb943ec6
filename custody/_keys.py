"""The commands that run with the daemon stopped, or beside it without serving: `keys init`,
`keys rotate` / `keys migrate`, and the token check of `check-config --deep` and `status`.

None of them is in the custodian's message table: run them under the custodian's uid with
its `[pkcs11]` configuration (docs/custodian.md). The processes that serve requests (the
custodian, the in-process daemon) open custody through `_facade.Custody` and never load
this module, `_kekinit` or `_rotation`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from custody import _kekinit
from custody._activekek import recorded_kek
from custody._kekinit import TokenReport
from custody._process import harden_process
from custody._rotation import Journal, RotationReport, rotate
from custody._token import Token, TokenConfig
from custody._worker import in_token_worker

__all__ = ["check_token", "init_kek", "init_keys", "rotate_keys"]


async def init_keys(token: TokenConfig, state_dir: Path | None = None) -> TokenReport:
    """`buzz-broker keys init`: choose the seal by what the token offers, create the KEK
    (both halves for encrypt-then-MAC) where absent, else check it.

    With `state_dir`, the KEK is the one its keystore records as active (after a rotation),
    and a keystore whose keys are in another token is refused.

    Returns:
        What the token offers, the seal chosen, and which keys were created.
    Raises:
        CustodyError: token, PIN or module faults, a forced seal the token lacks, a token
            that cannot generate a missing key, or a present key that fails its checks.
    """
    harden_process()  # the PIN is about to be read: no core, no same-uid ptrace
    label = token.kek_label
    if state_dir is not None:
        label = recorded_kek(token, Path(state_dir)).kek_label
    return await in_token_worker(lambda: _kekinit.init_kek(token, label))


async def init_kek(token: TokenConfig) -> bool:
    """`init_keys` without a state directory. True if any key was created."""
    return bool((await init_keys(token)).created)


async def rotate_keys(
    source: TokenConfig,
    state_dir: Path,
    *,
    target: TokenConfig | None = None,
    new_kek_label: str | None = None,
    checkpoint: Callable[[str], None] | None = None,
    journal: Journal | None = None,
) -> RotationReport:
    """`keys rotate` (target None: a new KEK in the same token) and `keys migrate` (the
    token `target` names). See `_rotation` for the steps and the crash guarantees.

    `checkpoint` is a test seam (the crash tests kill the process there); production
    passes None. `journal` records the run while the state lock is held (`_rotation`).

    Raises:
        CustodyError: custody in use (the daemon runs), a wrong token, a blob that does
            not open, a token that refuses; the message says what to do.
    """
    harden_process()

    return await in_token_worker(
        lambda: rotate(source, target or source, Path(state_dir), new_kek_label, checkpoint,
                       journal))


async def check_token(token: TokenConfig, state_dir: Path | None = None) -> str:
    """`check-config --deep` and `status`: log in, find and check the KEK, use it
    (`Token.check`, the check the custodian's `token` row makes), log out.

    With `state_dir`, the KEK is the one its keystore records as active (after a rotation),
    and a keystore whose keys are in another token is refused, as for `init_keys`. Writes
    nothing and creates nothing. Returns the KEK label checked.

    Raises:
        CustodyError: as `Custody.open` does.
        OSError: the keystore could not be read (another user's state directory).
    """
    harden_process()  # the PIN is about to be read: no core, no same-uid ptrace
    label = token.kek_label
    if state_dir is not None:
        label = recorded_kek(token, Path(state_dir)).kek_label

    def work() -> None:
        opened = Token.open(token, label)
        try:
            opened.check()
        finally:
            opened.close()

    await in_token_worker(work)
    return label
