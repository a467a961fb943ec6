"""`buzz-broker call ACTION --args JSON`: one operation through the agent client, by hand.

Rules:
- The request is built and checked by the same client an agent uses (`daemon.client`):
  frozen once, retried with identical bytes, and judged against itself (spec [C1]).
  Bad `--args` JSON or a contract violation is a one-line error and nothing is sent.
- The credential comes from `--credential-file` or `$BUZZ_BROKER_CREDENTIAL`, never
  from argv (argv is visible to every user of the machine through /proc).
- stdout carries exactly one JSON object: the host's verdict envelope as received, or,
  when there was no verdict, a `client_result` object saying so (below). The credential
  never appears in it, nor in any error line.

Exit codes (the only way a script should branch):

====  =================================================================
0     succeeded
1     could not run: no credential, unreadable file, bad config
2     usage: bad --args JSON, or arguments the contract rejects (nothing sent)
3     failed — the host promises nothing happened
4     unsupported on a best-effort operation (reaction.add) — carry on
5     indeterminate — fate unknown; retry with the same --request-id and --args
6     no answer — fate unknown; retry with the same --request-id and --args
====  =================================================================

The `client_result` object for "no answer":
`{"type":"client_result","status":"no_answer","requestId":…,"action":…,"attempts":…,
"reason":"transport|no_envelope|mismatch|unverified_event","detail":…}`.

WARNING: the exit codes and the `client_result` object are also documented in
docs/agents.md ("By hand") and pinned by tests/client/test_call_cli.py; change all three together.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys

from daemon.cli._common import CliError, config_from_args

HELP = "perform one operation through the broker as an agent, and print the verdict"

EXIT_SUCCEEDED = 0
EXIT_CANNOT_RUN = 1
EXIT_USAGE = 2
EXIT_FAILED = 3
EXIT_UNSUPPORTED = 4
EXIT_INDETERMINATE = 5
EXIT_NO_ANSWER = 6

#: The environment variable a credential may come from when no file is named.
CREDENTIAL_ENV = "BUZZ_BROKER_CREDENTIAL"

#: Bound on the credential file: a session credential is a short token.
_MAX_CREDENTIAL_FILE = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", metavar="ACTION", help="operation wire name, e.g. message.post")
    parser.add_argument(
        "--args", dest="call_args", metavar="JSON", required=True,
        help='the operation\'s arguments as a JSON object, e.g. \'{"channelId":"…","content":"hi"}\'',
    )
    parser.add_argument(
        "--credential-file", metavar="FILE",
        help=f"file holding the session credential (default: ${CREDENTIAL_ENV})",
    )
    parser.add_argument(
        "--socket", metavar="PATH",
        help="broker socket path, or http://127.0.0.1:PORT (default: server.socket from the config)",
    )
    parser.add_argument(
        "--request-id", metavar="ID",
        help="idempotency key; reuse it to retry the same operation (default: a new UUID)",
    )


def _read_credential(path: str | None) -> str:
    if path is None:
        value = os.environ.get(CREDENTIAL_ENV, "")
        if not value.strip():
            raise CliError(f"no credential: pass --credential-file or set ${CREDENTIAL_ENV}")
        return value.strip()
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            raw = handle.read(_MAX_CREDENTIAL_FILE + 1)
    except OSError as exc:
        raise CliError(f"cannot read credential file {path}: {exc.strerror}") from None
    if len(raw) > _MAX_CREDENTIAL_FILE:
        raise CliError(f"credential file {path} is too large to be a credential")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # Like ssh with a private key, but a warning: the file may be on a mount that
        # cannot express modes. The guide asks for 0400.
        print(
            f"buzz-broker: warning: credential file {path} is readable by others "
            f"(mode {stat.S_IMODE(mode):04o}); make it 0400",
            file=sys.stderr,
        )
    try:
        value = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CliError(f"credential file {path} does not hold an ASCII credential") from None
    if not value:
        raise CliError(f"credential file {path} is empty")
    return value


def run(args: argparse.Namespace) -> int:
    # Imported here so other commands never pay for (or break on) the client's imports.
    from daemon.client import (
        AsyncBrokerClient,
        Failed,
        Indeterminate,
        NoAnswer,
        Succeeded,
        Unsupported,
    )
    from buzzwire.contract import ContractError

    try:
        call_args = json.loads(args.call_args)
    except json.JSONDecodeError as exc:
        raise CliError(f"--args is not valid JSON: {exc.msg} at column {exc.colno}", EXIT_USAGE) from None
    if not isinstance(call_args, dict):
        raise CliError("--args must be a JSON object", EXIT_USAGE)

    address = args.socket if args.socket else config_from_args(args).server.socket
    credential = _read_credential(args.credential_file)
    try:
        client = AsyncBrokerClient(address, credential)
    except ValueError as exc:
        # The client's messages never quote the credential.
        raise CliError(str(exc), EXIT_CANNOT_RUN) from None
    try:
        request = client.freeze(args.action, call_args, args.request_id)
    except ContractError as exc:
        raise CliError(
            f"{args.action}: {exc.code.value} at {exc.pointer or '/'}: {exc.detail}", EXIT_USAGE
        ) from None

    import trio

    answer = trio.run(client.send, request)

    if isinstance(answer, NoAnswer):
        sys.stdout.write(
            json.dumps(
                {
                    "type": "client_result",
                    "status": "no_answer",
                    "requestId": answer.request_id,
                    "action": answer.action,
                    "attempts": answer.attempts,
                    "reason": answer.reason.value,
                    "detail": answer.detail,
                },
                separators=(",", ":"),
                ensure_ascii=False,
            )
            + "\n"
        )
        return EXIT_NO_ANSWER
    # Every other answer is a host verdict that passed the I5 checks: print it verbatim.
    sys.stdout.write(answer.envelope.decode("utf-8") + "\n")
    if isinstance(answer, Succeeded):
        return EXIT_SUCCEEDED
    if isinstance(answer, Unsupported):
        return EXIT_UNSUPPORTED
    if isinstance(answer, Failed):
        return EXIT_FAILED
    assert isinstance(answer, Indeterminate)
    return EXIT_INDETERMINATE
