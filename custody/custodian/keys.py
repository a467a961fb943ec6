"""`buzz-broker custodian FILE keys init|rotate|migrate`: the KEK, with the custodian stopped.

Why its own command: making, rotating and moving the key-encryption key are not in the
message table (a compromised pipeline must not start one), and they need what only the
custodian's uid can reach, the PIN and the token's files. So they run as this command,
under that uid, from the custodian's own configuration FILE (its `[pkcs11]` and
`state_dir`); the serving process never imports this module (tests/custodian/test_size.py).

Rules:
- `init` makes the KEK where absent, else checks it (custody/_kekinit.py); safe to repeat.
- `rotate [--new-kek-label L]` reseals every agent under a new KEK in the same token,
  `migrate --to-config FILE2 [--new-kek-label L]` under one in the token FILE2's
  `[pkcs11]` names; both then destroy the old KEK (custody/_rotation.py: crash-safe, run
  again to finish). They hold the state directory's lock exclusively: they refuse while
  the custodian runs, and it refuses to start meanwhile (custody/_statelock.py).
- Each rotation or migration is a line in the custodian's own hash-chained log (ledger.py),
  before the answer is printed: op, the old and new token and KEK labels, the agent count.
- Prints public lines only; a fault is one line on stderr and exit 1 (main.py).
"""

from __future__ import annotations

from custody._keys import init_keys, rotate_keys
from custody.custodian.config import ConfigError, CustodianConfig, load
from custody.custodian.ledger import SignLog

__all__ = ["USAGE", "run"]

USAGE = ("keys init | keys rotate [--new-kek-label LABEL] | "
         "keys migrate --to-config FILE2 [--new-kek-label LABEL]")
#: subcommand -> the options it takes (each with one value)
_OPTIONS = {"init": (), "rotate": ("--new-kek-label",),
            "migrate": ("--to-config", "--new-kek-label")}


def _options(command: str, words: list[str]) -> dict[str, str]:
    if command not in _OPTIONS or len(words) % 2:
        raise ConfigError(f"usage: buzz-broker custodian FILE {USAGE}")
    options = dict(zip(words[::2], words[1::2], strict=True))
    unknown = set(options) - set(_OPTIONS[command])
    if unknown or (command == "migrate" and "--to-config" not in options):
        raise ConfigError(f"usage: buzz-broker custodian FILE {USAGE}")
    return options


async def run(config: CustodianConfig, words: list[str]) -> None:
    """Run `keys WORDS...` for `config`. Raises ConfigError (usage, FILE2) or CustodyError."""
    command = words[0] if words else ""
    options = _options(command, words[1:])
    if command == "init":
        made = await init_keys(config.token, config.state_dir)
        created = ", ".join(made.created) or "none (present and checked)"
        print(f"custodian: KEK {made.kek_label!r} in token {made.token_label!r}, seal "
              f"{made.seal}; keys created: {created}", flush=True)
        return
    target = load(options["--to-config"]).token if command == "migrate" else None
    if target is not None and (target.token_label, target.module) == (
            config.token.token_label, config.token.module):
        raise ConfigError("--to-config names the same token; use `keys rotate`")
    report = await rotate_keys(config.token, config.state_dir, target=target,
                               new_kek_label=options.get("--new-kek-label"))
    log = SignLog(config.settings.log_path, config.settings.log_max_bytes)
    try:
        log.append([{"op": command, "agents": report.agents, "outcome": report.outcome,
                     "old_token": report.old.token_label, "old_kek": report.old.kek_label,
                     "new_token": report.new.token_label, "new_kek": report.new.kek_label}])
    finally:
        log.close()
    print(f"custodian: {report.agents} agents under KEK {report.new.kek_label!r} in token "
          f"{report.new.token_label!r} ({report.outcome}); destroyed: "
          f"{', '.join(report.destroyed) or 'none'}", flush=True)
