"""The relay side: the NIP-01 / NIP-42 client and the read path over it.

Modules: `protocol` (sans-IO: frame encoders, the strict frame parser, relay URL rules),
`pool` (the connections, AUTH, publish and query, with every bound), `paging` (a read's
filters and pages) and `cursor` (the sealed cursors an agent carries between pages).

Rules:
- Everything the relay sends is hostile: parsed strictly by `protocol`, bounded by `pool`
  (`MAX_QUERY_BYTES`), never trusted to be in order or complete.
- No secret key here: AUTH and events are signed by custody and handed in.
- This package imports nothing at import time: each module is imported by its full name.
"""
