"""`buzz-broker call` against the scripted host: exit codes, stdout, and no credential leak.

`main` runs in a worker thread because the command runs an event loop itself; the scripted
host runs on the test's loop, asyncio and trio in turn (`any_loop`).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import anyio
import pytest

from daemon import cli
from daemon.cli.call import (
    EXIT_CANNOT_RUN,
    EXIT_FAILED,
    EXIT_INDETERMINATE,
    EXIT_NO_ANSWER,
    EXIT_SUCCEEDED,
    EXIT_UNSUPPORTED,
    EXIT_USAGE,
)
from tests.client.scripted_host import (
    HttpAnswer,
    Received,
    ScriptedHost,
    drop,
    errored,
    publish_outcome,
    succeeded,
)

CHANNEL = "5df7dfa8-e919-43df-8efd-f1dcb8af7071"
TARGET = "cacf5f811cc8ef3f4af3f92cc222f92a86cdf6a26728a144c8e63b74ab6db359"
CREDENTIAL = "bb1.cli-credential-0b5d4e8a9c713f2b6d8e4a10"

pytestmark = pytest.mark.any_loop


@pytest.fixture
def credential_file(tmp_path: Path) -> str:
    path = tmp_path / "credential"
    path.write_text(CREDENTIAL + "\n")
    path.chmod(0o400)
    return str(path)


async def run_cli(argv: list[str]) -> int:
    return await anyio.to_thread.run_sync(lambda: cli.main(argv))


def post_args(host: ScriptedHost, credential_file: str, *extra: str) -> list[str]:
    return ["call", "message.post", "--args", json.dumps({"channelId": CHANNEL, "content": "hi"}),
            "--socket", host.path, "--credential-file", credential_file, *extra]


def assert_no_credential(capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    out, err = capsys.readouterr()
    assert CREDENTIAL not in out and CREDENTIAL not in err
    return out, err


async def test_succeeded_prints_the_envelope_and_exits_0(
    host: ScriptedHost, credential_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    host.script = [succeeded(None, publish_outcome())]
    code = await run_cli(post_args(host, credential_file, "--request-id", "cli-req-1"))
    out, _ = assert_no_credential(capsys)
    assert code == EXIT_SUCCEEDED
    printed = json.loads(out)
    assert printed["status"] == "succeeded" and printed["requestId"] == "cli-req-1"
    assert out.encode() == host.answered[0] + b"\n"  # the host's envelope, verbatim
    assert host.received[0].headers[b"authorization"] == b"Bearer " + CREDENTIAL.encode()


@pytest.mark.parametrize(
    ("steps", "action", "expected", "attempts"),
    [
        ([errored("failed", "unauthorized")], "message.post", EXIT_FAILED, 1),
        ([errored("failed", "unsupported")], "reaction.add", EXIT_UNSUPPORTED, 1),
        ([errored("failed", "unsupported")], "message.post", EXIT_FAILED, 1),
        ([errored("indeterminate", "outcome_unknown")] * 4, "message.post", EXIT_INDETERMINATE, 4),
        ([drop()] * 4, "message.post", EXIT_NO_ANSWER, 4),
    ],
)
async def test_exit_code_per_verdict(
    host: ScriptedHost, credential_file: str, capsys: pytest.CaptureFixture[str],
    steps: list[object], action: str, expected: int, attempts: int,
) -> None:
    host.script = list(steps)  # type: ignore[arg-type]
    args = ({"channelId": CHANNEL, "targetEventId": TARGET, "reaction": "+"}
            if action == "reaction.add" else {"channelId": CHANNEL, "content": "hi"})
    code = await run_cli(["call", action, "--args", json.dumps(args), "--socket", host.path,
                          "--credential-file", credential_file])
    out, _ = assert_no_credential(capsys)
    assert code == expected
    printed = json.loads(out)
    if expected == EXIT_NO_ANSWER:
        assert printed["type"] == "client_result" and printed["status"] == "no_answer"
        assert printed["reason"] == "transport" and printed["attempts"] == attempts
    else:
        assert printed["type"] == "broker_result"
    assert len(host.received) == attempts
    assert len(set(host.bodies)) == 1  # every retry sent the same bytes


async def test_credential_from_environment(
    host: ScriptedHost, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUZZ_BROKER_CREDENTIAL", CREDENTIAL)
    host.script = [succeeded(None, publish_outcome())]
    code = await run_cli(["call", "message.post", "--args",
                          json.dumps({"channelId": CHANNEL, "content": "hi"}), "--socket", host.path])
    assert_no_credential(capsys)
    assert code == EXIT_SUCCEEDED
    assert host.received[0].headers[b"authorization"] == b"Bearer " + CREDENTIAL.encode()


@pytest.mark.parametrize(
    "call_args",
    ['{"channelId": ', "[1, 2]", '{"channelId":"nope","content":"hi"}',
     '{"channelId":"%s","content":"hi","owner":"x"}' % CHANNEL,
     '{"channelId":"%s","content":null}' % CHANNEL,
     # A member given twice: the wire refuses it, and so does its own tool (json.loads kept
     # the last value and posted it).
     '{"channelId":"%s","content":"first","content":"second"}' % CHANNEL,
     '{"channelId":"%s","content":"\\ud800"}' % CHANNEL],
)
async def test_bad_args_is_a_usage_error_and_nothing_is_sent(
    host: ScriptedHost, credential_file: str, capsys: pytest.CaptureFixture[str], call_args: str
) -> None:
    code = await run_cli(["call", "message.post", "--args", call_args, "--socket", host.path,
                          "--credential-file", credential_file])
    out, err = assert_no_credential(capsys)
    assert code == EXIT_USAGE and out == ""
    assert err.startswith("buzz-broker: ") and err.count("\n") == 1
    assert host.received == []


async def test_reserved_name_is_refused_before_sending(
    host: ScriptedHost, credential_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = await run_cli(["call", "sign", "--args", "{}", "--socket", host.path,
                          "--credential-file", credential_file])
    assert_no_credential(capsys)
    assert code == EXIT_USAGE and host.received == []


async def test_no_credential_is_a_clear_error(
    host: ScriptedHost, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.delenv("BUZZ_BROKER_CREDENTIAL", raising=False)
    monkeypatch.delenv("BUZZ_BROKER_CREDENTIAL_FILE", raising=False)
    args = ["call", "message.post", "--args", json.dumps({"channelId": CHANNEL, "content": "x"}),
            "--socket", host.path]
    assert await run_cli(args) == EXIT_CANNOT_RUN
    err = capsys.readouterr().err
    assert "BUZZ_BROKER_CREDENTIAL" in err
    # The shell's own way, not the Python keyword: `call` takes no `credential_file=`.
    assert err.rstrip().endswith("or pass --credential-file FILE") and "credential_file=" not in err
    assert await run_cli([*args, "--credential-file", str(tmp_path / "missing")]) == EXIT_CANNOT_RUN
    assert "cannot read credential file" in capsys.readouterr().err
    assert host.received == []


async def test_open_credential_file_warns_and_plain_http_elsewhere_is_refused(
    host: ScriptedHost, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    loose = tmp_path / "loose"
    loose.write_text(CREDENTIAL)
    loose.chmod(0o644)
    host.script = [succeeded(None, publish_outcome())]
    assert await run_cli(post_args(host, str(loose))) == EXIT_SUCCEEDED
    _, err = assert_no_credential(capsys)
    assert "readable by others" in err
    code = await run_cli(["call", "message.post", "--args",
                          json.dumps({"channelId": CHANNEL, "content": "hi"}),
                          "--socket", "http://192.0.2.1:80", "--credential-file", str(loose)])
    _, err = assert_no_credential(capsys)
    assert code == EXIT_CANNOT_RUN and "loopback" in err


async def test_socket_defaults_to_the_configured_one(
    host: ScriptedHost, credential_file: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(f'[server]\nsocket = "{host.path}"\n')
    host.script = [succeeded(None, publish_outcome())]
    code = await run_cli(["--config", str(config), "call", "message.post", "--args",
                          json.dumps({"channelId": CHANNEL, "content": "hi"}),
                          "--credential-file", credential_file])
    assert_no_credential(capsys)
    assert code == EXIT_SUCCEEDED and len(host.received) == 1


def test_credential_file_fixture_is_0400(credential_file: str) -> None:
    assert stat.S_IMODE(os.stat(credential_file).st_mode) == 0o400


async def test_socket_from_the_environment_and_a_missing_one_said_plainly(
    host: ScriptedHost, credential_file: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BUZZ_BROKER_SOCKET", host.path)
    host.script = [succeeded(None, publish_outcome())]
    args = ["call", "message.post", "--args", json.dumps({"channelId": CHANNEL, "content": "hi"}),
            "--credential-file", credential_file]
    assert await run_cli(args) == EXIT_SUCCEEDED and len(host.received) == 1
    assert_no_credential(capsys)
    monkeypatch.setenv("BUZZ_BROKER_SOCKET", "/tmp/bbc-nonexistent/broker.sock")
    assert await run_cli(args) == EXIT_CANNOT_RUN
    out, err = assert_no_credential(capsys)
    assert out == "" and "no broker socket at unix:/tmp/bbc-nonexistent/broker.sock" in err
    assert err.count("\n") == 1


async def test_refused_credential_prints_the_verdict_and_says_what_to_do(
    host: ScriptedHost, credential_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    host.script = [errored("failed", "unauthenticated")]
    assert await run_cli(post_args(host, credential_file)) == EXIT_FAILED
    out, err = assert_no_credential(capsys)
    assert out.encode() == host.answered[0] + b"\n"
    assert "refused this credential" in err and len(host.received) == 1


@pytest.mark.parametrize(
    ("first", "expected"),
    [(errored("indeterminate", "outcome_unknown"), EXIT_INDETERMINATE), (drop(), EXIT_NO_ANSWER)],
    ids=["indeterminate", "dropped"],
)
async def test_refused_credential_after_an_unknown_fate_is_not_nothing_happened(
    host: ScriptedHost, credential_file: str, capsys: pytest.CaptureFixture[str],
    first: object, expected: int,
) -> None:
    # The first attempt may have posted; the credential was refused on the retry. Exit 3
    # would tell a script "nothing happened, send a new request": a second post.
    host.script = [first, errored("failed", "unauthenticated")]  # type: ignore[list-item]
    code = await run_cli(post_args(host, credential_file))
    out, _ = assert_no_credential(capsys)
    assert code == expected and len(host.received) == 2
    printed = json.loads(out)
    if expected == EXIT_INDETERMINATE:
        assert out.encode() == host.answered[0] + b"\n"
    else:
        assert printed["status"] == "no_answer" and printed["attempts"] == 2


async def test_a_pretty_printed_envelope_is_still_one_json_object(
    host: ScriptedHost, credential_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Whitespace between tokens is valid JSON a host may send; it must not come out as
    # `\u000a` outside a string (not JSON), nor as raw newlines (one object per line).
    def pretty(got: Received) -> HttpAnswer:
        env = {"type": "broker_result", "protocolVersion": 1,
               "requestId": got.json()["requestId"], "status": "failed",
               "error": {"code": "action_failed", "message": "line one\nline\ttwo \u202e"}}
        return HttpAnswer(200, json.dumps(env, indent="\t", ensure_ascii=False).replace(
            "\n", "\r\n").encode())

    host.script = [pretty]
    code = await run_cli(post_args(host, credential_file))
    out, _ = assert_no_credential(capsys)
    assert code == EXIT_FAILED
    assert out.endswith("\n") and out.count("\n") == 1 and "\r" not in out and "\t" not in out
    assert json.loads(out) == json.loads(host.answered[0])
    assert "\u202e" not in out


async def test_a_credential_given_as_the_credential_file_is_not_printed(
    host: ScriptedHost, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "bzb_Qm9ndXMtdG9rZW4tZm9yLXRlc3RzLW9ubHktMDEyMzQ"  # the broker's token shape
    args = ["call", "message.post", "--args", json.dumps({"channelId": CHANNEL, "content": "x"}),
            "--socket", host.path]
    monkeypatch.delenv("BUZZ_BROKER_CREDENTIAL", raising=False)
    assert await run_cli([*args, "--credential-file", token]) == EXIT_CANNOT_RUN
    out, err = capsys.readouterr()
    assert out == "" and "looks like a credential" in err and token not in err
    monkeypatch.setenv("BUZZ_BROKER_CREDENTIAL_FILE", token)
    assert await run_cli(args) == EXIT_CANNOT_RUN
    out, err = capsys.readouterr()
    assert out == "" and "looks like a credential" in err and token not in err
    assert host.received == []


def test_the_usage_code_is_the_packages_one_not_a_copy() -> None:
    """One table per fact: `call`'s EXIT_USAGE is daemon/cli/_common.py's, imported, so the
    two cannot drift (call.py kept its own `EXIT_USAGE = 2`)."""
    import ast
    import inspect

    from daemon.cli import call

    tree = ast.parse(inspect.getsource(call))
    assigned = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}
    assigned |= {node.target.id for node in ast.walk(tree)
                 if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    assert "EXIT_USAGE" not in assigned
    assert EXIT_USAGE == cli.EXIT_USAGE
