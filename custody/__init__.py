"""custody: HAZARDOUS MATERIALS. The only code in buzz-broker that ever sees a secret key.

What it guards: agents' secp256k1 secret keys, sealed under a non-extractable AES-256 key
in a PKCS#11 token, and the NIP-AE conversation keys derived from them. Nothing it returns,
logs or raises contains a secret key, a K_c or a PIN.

Who may import it: `daemon` (through this surface only: never a `custody._*` module), the
command line, the tests and the benchmarks. `custody` imports nothing from `daemon`.

Surface:
- `Custody` (async facade: open/aclose, agent/agents, sign_event/sign_events/sign_auth,
  memory_address, encrypt_to_owner/decrypt_from_owner_pair (NIP-44 v2 between an agent and
  its recorded owner, one unseal per call), mint_agent, import_agent, destroy_agent),
  `init_keys`/`init_kek` (keys init), `rotate_keys` (keys rotate, keys migrate;
  `ROTATION_CHECKPOINTS`) and `check_token` (log in and check the KEK only: check-config
  --deep, status).
- Values: `TokenConfig`, `CachePolicy`, `RecordBound` (how many key records mints and
  imports may make, `DEFAULT_MAX_RECORDS` unless configured), `TokenReport`,
  `RotationReport`, `UnsignedEvent`, `SignedEvent`, `KeyRecord` (an agent key's public
  facts: owner, NIP-OA tag, mint reference, when made and destroyed), `MemoryAddress`.
- `KeyIndex`: those records read-only, without the token (the daemon's directory).
- `forget_removed` (`_forget`: drop destroyed records, named, without the token; refused
  as a whole with `NotForgotten`): `agent forget`, the way back under the record bound.
- Backups: `export_backup` (`_backup`: every live agent encrypted in memory to age
  recipients, with the caller's public entry for each), `open_backup` (`_restore`:
  decrypt and check one), `restore_plan`, `restore_backup`.
- Errors: `CustodyError`, `UnsealFailed`, `UnknownAgent`.
- Public Nostr helpers (no secrets): `compute_event_id`, `verify_event`,
  `verify_owner_tag`, `owner_tag_digest`. The public agent directory (names, creators,
  depth, renames, listing) is not here: it is the daemon's (daemon/state/directory.py).
  `read_secret_text` reads secret text from a file descriptor
  into a zeroable buffer for `Custody.import_agent`; `read_limited` reads any bounded
  secret file (an age identity) the same way. `harden_process` (no core dumps, not
  dumpable) runs inside `Custody.open`/`init_kek`; callers may run it earlier too.

Modules, one job each: _errors, _secret (buffers, wiping, parsing, randomness), _secp256k1
(low-level curve ops), _signer (events, AUTH, NIP-OA), _nip44 (NIP-44 v2 payloads), _nipae
(NIP-AE), _backup (the age backup format and writing one), _restore (opening and
restoring one), _ownership (the owner graph's cycle check),
_process (core dumps off, undumpable), _worker (the one token thread),
_token (PKCS#11: login, KEKs, mechanisms, the seal choice), _sealed (blob formats, the two
seals and the one unseal door with its named defences), _cache (the unsealed-key cache,
off by default), _records (the public values), _keystore (SQLite), _keyindex (it read
without custody open: the daemon's), _statelock (who may use the state directory),
_activekek (the token and KEK the keystore records), _forget (forgetting destroyed records:
the custodian's and `agent forget`'s rule), _facade (Custody). Run only with the
daemon stopped or beside it, never by a serving process: _keys (keys init, rotate,
migrate; the token check), _kekinit (making and destroying KEKs), _rotation, _files (an
operator's bounded file or input: the restore commands' backup and identity, `agent
import`'s secret text).

WARNING: custody refuses to be imported under `python -O`/`-OO`/PYTHONOPTIMIZE. Its own
code checks every C return with `if`, never `assert`; the refusal is belt and braces for
the libraries and future code it relies on, where a stripped check would not fail loudly
but yield wrong keys.
"""

import sys

if sys.flags.optimize:
    # ImportError, raised before anything else loads: a daemon or CLI started with -O
    # stops at once with this line instead of signing with checks stripped.
    raise ImportError(
        "custody refuses to run under python -O or PYTHONOPTIMIZE: assert statements are "
        "stripped there, and custody's safety checks must never be; start Python without -O"
    )

from typing import TYPE_CHECKING

# The surface is loaded on first use (PEP 562), module by module: a process that needs only
# custody's errors and public records (the pipeline when a custodian holds the keys,
# custody/custodian/client.py) never imports python-pkcs11 nor maps the PKCS#11 module.
#: public name -> the module that defines it
_SURFACE: dict[str, str] = {
    **dict.fromkeys(("MAX_PUBLIC_BYTES", "ExportedBackup", "export_backup"), "custody._backup"),
    **dict.fromkeys(("MAX_BACKUP_BYTES", "MAX_IDENTITY_BYTES", "BackupContents",
                     "RestoreResult", "open_backup", "restore_backup", "restore_plan"),
                    "custody._restore"),
    **dict.fromkeys(("CustodyError", "UnknownAgent", "UnsealFailed"), "custody._errors"),
    **dict.fromkeys(("Custody", "HeldOwner"), "custody._facade"),
    **dict.fromkeys(("check_token", "init_kek", "init_keys", "rotate_keys"), "custody._keys"),
    "KeyIndex": "custody._keyindex",
    **dict.fromkeys(("NotForgotten", "forget_removed"), "custody._forget"),
    **dict.fromkeys(("CachePolicy", "KeyRecord", "MemoryAddress", "MAX_CACHE_ENTRIES",
                     "MAX_CACHE_SECONDS", "MAX_KEK_LABEL", "MAX_UID", "kek_label_ok",
                     "DEFAULT_MAX_RECORDS", "RecordBound"),
                    "custody._records"),
    **dict.fromkeys(("SignedEvent", "UnsignedEvent", "compute_event_id", "owner_tag_digest",
                     "verify_event", "verify_owner_tag"), "buzzwire.nostr"),
    "harden_process": "custody._process",
    "read_limited": "custody._secret",
    "read_secret_text": "custody._files",
    **dict.fromkeys(("ROTATION_CHECKPOINTS", "RotationReport"), "custody._rotation"),
    "TokenConfig": "custody._token",
    "TokenReport": "custody._kekinit",
}


def __getattr__(name: str) -> object:
    module = _SURFACE.get(name)
    if module is None:
        raise AttributeError(f"module 'custody' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # the same surface for type checkers (`X as X`: re-exported names)
    from buzzwire.nostr import SignedEvent as SignedEvent, UnsignedEvent as UnsignedEvent
    from buzzwire.nostr import compute_event_id as compute_event_id
    from buzzwire.nostr import owner_tag_digest as owner_tag_digest
    from buzzwire.nostr import verify_event as verify_event, verify_owner_tag as verify_owner_tag
    from custody._backup import MAX_PUBLIC_BYTES as MAX_PUBLIC_BYTES
    from custody._backup import ExportedBackup as ExportedBackup, export_backup as export_backup
    from custody._restore import MAX_BACKUP_BYTES as MAX_BACKUP_BYTES
    from custody._restore import MAX_IDENTITY_BYTES as MAX_IDENTITY_BYTES
    from custody._restore import BackupContents as BackupContents, RestoreResult as RestoreResult
    from custody._restore import open_backup as open_backup, restore_backup as restore_backup
    from custody._restore import restore_plan as restore_plan
    from custody._errors import CustodyError as CustodyError, UnknownAgent as UnknownAgent
    from custody._errors import UnsealFailed as UnsealFailed
    from custody._facade import Custody as Custody, HeldOwner as HeldOwner
    from custody._kekinit import TokenReport as TokenReport
    from custody._keys import check_token as check_token, init_kek as init_kek
    from custody._keys import init_keys as init_keys, rotate_keys as rotate_keys
    from custody._keyindex import KeyIndex as KeyIndex
    from custody._forget import NotForgotten as NotForgotten, forget_removed as forget_removed
    from custody._records import CachePolicy as CachePolicy, KeyRecord as KeyRecord
    from custody._records import MAX_CACHE_ENTRIES as MAX_CACHE_ENTRIES, MemoryAddress as MemoryAddress
    from custody._records import MAX_CACHE_SECONDS as MAX_CACHE_SECONDS, MAX_UID as MAX_UID
    from custody._records import MAX_KEK_LABEL as MAX_KEK_LABEL, kek_label_ok as kek_label_ok
    from custody._records import DEFAULT_MAX_RECORDS as DEFAULT_MAX_RECORDS
    from custody._records import RecordBound as RecordBound
    from custody._process import harden_process as harden_process
    from custody._rotation import ROTATION_CHECKPOINTS as ROTATION_CHECKPOINTS
    from custody._rotation import RotationReport as RotationReport
    from custody._secret import read_limited as read_limited
    from custody._files import read_secret_text as read_secret_text
    from custody._token import TokenConfig as TokenConfig

#: The surface, from the one table above (`from custody import *` would load all of it).
__all__ = sorted(_SURFACE)
