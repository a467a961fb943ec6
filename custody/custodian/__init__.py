"""custodian: the process that holds the keys, answering a closed table of requests.

The pipeline (daemon/) talks to it over one Unix socket only its uid may use; it never
sees the PIN, the token or an unsealed key (docs/custodian.md says what is separated
where, and what a compromised pipeline can still do).

Parts, one job each:
- `messages`: the closed, versioned message table and its strict frame reader (pure).
- `intents`: the closed list of event kinds and shapes it signs, and who may sign each.
- `ledger`: its own hash-chained log of what it signed, and per-agent rate bounds.
- `grace`: destroy's grace period (the sealed copy an operator can recover).
- `backup`: the backup row's file, to the custodian's own recipients and directory.
- `server`: the socket, the peer-uid check, one handler per table row.
- `config`, `main`: its own configuration file and entry point; `keys`: the KEK commands
  run with it stopped, `recover`: `--recover` beside it, `verify`: `--verify-log`, its log's
  chain checked (none loaded by the serving process).
- `client`: the pipeline's side, the only part the daemon imports (it never imports the
  PKCS#11 binding), with `records`, its snapshot of the public key records.
The unseal door, the curve operations, NIP-44/NIP-AE and the token are `custody`'s
modules (_sealed, _secp256k1/_signer, _nip44/_nipae, _token/_worker), which only this
process opens when a custodian is configured.
"""
