"""Durable state: what the daemon keeps on disk between requests and across restarts.

Modules: `sessions` (credential -> principal), `ledger` (idempotency, the pending record's
bytes) and `sweep_clock` (the time its retention sweep may believe), `audit` (the
tamper-evident audit log) and `refusal_audit` (refusals past a burst counted into it),
`verdict_store` (a refusal stored as its code), `ratelimit` (limits and quotas), `runtimes`
(the host's record of each agent's runtime), `directory` (the public agent directory: names,
creators, depth, renames, listing), `runlock` (one daemon per state directory);
`_group_commit` and `_sqlite` are the shared engines.

Rules:
- Every store is opened and closed by `daemon.wiring`; nothing here talks to the relay or
  calls custody (`directory` reads custody's public key facts through `custody.KeyIndex`,
  read-only and without the token, or with a custodian through its record lookups), and nothing
  here decides a request: the pipeline asks, state answers.
- Files are created private (`_sqlite.open_private_db`); what is written is bounded by
  configuration, never by what a client sends.
- This package imports nothing at import time: each module is imported by its full name.
"""
