"""The pipeline: one request from its envelope to its answer.

Modules: `broker` (walks `PIPELINE`, the order stated once in README, "How a request is
judged"), `judgement` (validate → authorize → rate limit, an ordered table), `policy` (who
may act for whom), `publisher` (intent → pending → publish → cleanup), `pending` (the
pending record and its cleanup steps), `recorder` (each verdict to ledger, audit log, log
and metrics), `signing` (concurrent signing coalesced into one custody hop).

Rules:
- Data flows one way: the pipeline reads and writes `daemon.state` and asks `daemon.relay`
  and custody; neither of those imports the pipeline, except `daemon.state.ratelimit`
  for the `Refusal` value it answers with.
- `daemon.wiring` builds it; nothing here opens a store or a socket.
- This package imports nothing at import time: each module is imported by its full name.
"""
