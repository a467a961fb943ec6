"""`buzz-broker call ACTION --args JSON`: one operation through the agent client, by hand.

Rules:
- The request is built and checked by the same client an agent uses
  (`buzz_broker_client`): frozen once, retried with identical bytes, and judged against
  itself (spec [C1]). Bad `--args` JSON or a contract violation is a one-line error and
  nothing is sent.
- The credential comes from `--credential-file`, `$BUZZ_BROKER_CREDENTIAL` or
  `$BUZZ_BROKER_CREDENTIAL_FILE` (the client's own rules, `buzz_broker_client._env`),
  never from argv (argv is visible to every user of the machine through /proc).
- The socket is `--socket`, else `$BUZZ_BROKER_SOCKET`, else `server.socket` from the config.
- The client's setup errors (no socket, no permission on it, nothing listening) are a
  one-line error saying what to fix, exit 1; a refused credential prints the host's
  `failed` envelope like any failure (exit 3) and says what to do on stderr. After an
  attempt whose fate was unknown the client answers that fate instead (exit 5 or 6): the
  refusal says nothing about it (`buzz_broker_client.client`, "Retry").
- stdout carries exactly one JSON object, on one line: the host's verdict envelope as
  received (the same JSON value; whitespace between tokens is dropped, and controls, line
  separators and bidi overrides that read events may carry are written as `\\uNNNN`,
  `buzzwire.contract.printable_json_text`), or, when there was no verdict, a
  `client_result` object saying so (below). The credential never appears in it, nor in
  any error line.

Exit codes (the only way a script should branch):

====  =================================================================
0     succeeded
1     could not run: no credential, unreadable file, bad config, no socket, nothing
      listening, no permission on the socket
2     usage: bad --args JSON, or arguments the contract rejects (nothing sent)
3     failed — the host promises nothing happened
4     unsupported on a best-effort operation (reaction.add, the live signals, observer.emit, liveness.ping) — carry on
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
import sys

from daemon.cli._common import EXIT_USAGE, CliError, config_from_args

HELP = "perform one operation through the broker as an agent, and print the verdict"

EXIT_SUCCEEDED = 0
EXIT_CANNOT_RUN = 1
# EXIT_USAGE (2) is the package's one, imported above: `call`'s table of codes names it.
EXIT_FAILED = 3
EXIT_UNSUPPORTED = 4
EXIT_INDETERMINATE = 5
EXIT_NO_ANSWER = 6

#: The flag that names the credential file; the client's "no credential" message names it
#: too, so an operator at the shell is told this, not the Python keyword.
CREDENTIAL_FILE_FLAG = "--credential-file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", metavar="ACTION", help="operation wire name, e.g. message.post")
    parser.add_argument(
        "--args", dest="call_args", metavar="JSON", required=True,
        help='the operation\'s arguments as a JSON object, e.g. \'{"channelId":"…","content":"hi"}\'',
    )
    parser.add_argument(
        CREDENTIAL_FILE_FLAG, metavar="FILE",
        help="file holding the session credential "
             "(default: $BUZZ_BROKER_CREDENTIAL or $BUZZ_BROKER_CREDENTIAL_FILE)",
    )
    parser.add_argument(
        "--socket", metavar="PATH",
        help="broker socket path, or http://127.0.0.1:PORT "
             "(default: $BUZZ_BROKER_SOCKET, else server.socket from the config)",
    )
    parser.add_argument(
        "--request-id", metavar="ID",
        help="idempotency key; reuse it to retry the same operation (default: a new UUID)",
    )


def run(args: argparse.Namespace) -> int:
    # Imported here so other commands never pay for (or break on) the client's imports.
    import anyio

    from buzz_broker_client import (
        CREDENTIAL_FILE_ENV,
        SOCKET_ENV,
        AsyncBrokerClient,
        CredentialRefused,
        Failed,
        Indeterminate,
        NoAnswer,
        SetupError,
        Succeeded,
        Unsupported,
    )
    from buzz_broker_client._env import resolve_credential
    from buzzwire.contract import (
        ContractError, JsonSyntaxError, parse_json, printable, printable_json, printable_json_text,
    )

    # The wire's own strict reader: a member given twice, a null or a lone surrogate is
    # refused here as the host would refuse it, never settled by json.loads's last-wins.
    try:
        call_args, fault = parse_json(args.call_args.encode("utf-8", "surrogatepass"))
    except JsonSyntaxError as exc:
        raise CliError(f"--args is not valid JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(call_args, dict):
        raise CliError("--args must be a JSON object", EXIT_USAGE)
    if fault is not None:
        pointer, rule = fault
        raise CliError(f"--args at {printable(pointer or '/')}: {rule.reason()}", EXIT_USAGE)

    address = args.socket or os.environ.get(SOCKET_ENV, "").strip() or config_from_args(args).server.socket
    try:
        credential, read = resolve_credential(None, args.credential_file,
                                              file_option=f"{CREDENTIAL_FILE_FLAG} FILE")
        if read is not None and read.loose_mode is not None:
            # Like ssh with a private key, but a warning: the file may be on a mount that
            # cannot express modes. The guide asks for 0400.
            print(
                f"buzz-broker: warning: credential file "
                f"{args.credential_file or os.environ.get(CREDENTIAL_FILE_ENV)} is readable by "
                f"others (mode {read.loose_mode:04o}); make it 0400",
                file=sys.stderr,
            )
        client = AsyncBrokerClient(address, credential)
    except ValueError as exc:
        # NotConfigured is a ValueError too. The client's messages never quote the credential.
        raise CliError(str(exc), EXIT_CANNOT_RUN) from None
    try:
        request = client.freeze(args.action, call_args, args.request_id)
    except ContractError as exc:
        raise CliError(
            f"{args.action}: {exc.code.value} at {printable(exc.pointer or '/')}: {exc.reason}", EXIT_USAGE
        ) from None

    try:
        answer = anyio.run(client.send, request)
    except CredentialRefused as refused:
        # A verdict (nothing happened): printed like any failure, with what to do.
        print(f"buzz-broker: {printable(str(refused))}", file=sys.stderr)
        answer = refused.answer
    except SetupError as exc:
        raise CliError(str(exc), EXIT_CANNOT_RUN) from None

    if isinstance(answer, NoAnswer):
        sys.stdout.write(
            printable_json(
                {
                    "type": "client_result",
                    "status": "no_answer",
                    "requestId": answer.request_id,
                    "action": answer.action,
                    "attempts": answer.attempts,
                    "reason": answer.reason.value,
                    "detail": answer.detail,
                },
                compact=True,
            )
            + "\n"
        )
        return EXIT_NO_ANSWER
    # Every other answer is a host verdict that passed the I5 checks: print it as the same
    # JSON, with the characters a terminal acts on escaped (a read returns any author's text).
    sys.stdout.write(printable_json_text(answer.envelope.decode("utf-8")) + "\n")
    if isinstance(answer, Succeeded):
        return EXIT_SUCCEEDED
    if isinstance(answer, Unsupported):
        return EXIT_UNSUPPORTED
    if isinstance(answer, Failed):
        return EXIT_FAILED
    assert isinstance(answer, Indeterminate)
    return EXIT_INDETERMINATE
