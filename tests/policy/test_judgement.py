"""The pipeline's order as data: README's list, `PIPELINE`, and the judgement table agree,
and the judgement steps decide in table order (issue 16).

`test_each_step_refuses_in_table_order` walks `JUDGEMENT`: one request fails every step
at once; each step in turn must be the one that answers, and once its fault is mended the
next step in the table answers; with every fault mended the request is admitted, on the
records authorization resolved.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from buzzwire.contract import ErrorCode, Verdict, encode_request, read_request
from daemon.pipeline.broker import PIPELINE
from daemon.pipeline.judgement import JUDGEMENT, Admission, Admitted, judge
from daemon.pipeline.policy import REFUSALS
from daemon.state.ratelimit import RateLimiter, rate_config_from_table
from daemon.state.sessions import SessionStore
from tests.policy.test_policy import AGENTS, CHILD, HOST, ME, NOW, principal, request

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_steps() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## How a request is judged", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. \*\*([a-z]+)\*\*", section, flags=re.MULTILINE)


def test_the_pipeline_is_readmes_list() -> None:
    assert _readme_steps() == list(PIPELINE)


def _restatements(text: str) -> list[str]:
    """Every compact run of the eight step names in order (a list or an arrow chain); the
    README's numbered list is not compact (a paragraph between steps), so it is not one."""
    gap = r"[^\n]{0,24}?(?:\n[ \t]*)?[^\n]{0,24}?"
    pattern = gap.join(re.escape(step) for step in PIPELINE)
    return re.findall(pattern, text, flags=re.DOTALL)


def test_the_pipeline_order_is_stated_once() -> None:
    """README states the order; `PIPELINE` is it as data; nothing else restates it (issue 16
    item 5): a second statement is one more place to forget when the order changes."""
    repo = README.parent
    found = {}
    for path in [README, *sorted((repo / "docs").rglob("*.md")),
                 *sorted((repo / "daemon").rglob("*.py"))]:
        hits = _restatements(path.read_text(encoding="utf-8"))
        if hits:
            found[str(path.relative_to(repo))] = len(hits)
    assert found == {"daemon/pipeline/broker.py": 1}  # the `PIPELINE` tuple itself
    assert _restatements(repr(PIPELINE))


def test_judgement_phases_are_a_run_of_the_pipeline() -> None:
    phases = [phase for phase, _name, _step in JUDGEMENT]
    run = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    start = PIPELINE.index(run[0])
    assert list(PIPELINE[start:start + len(run)]) == run
    assert PIPELINE[start - 1] == "ledger" and PIPELINE[start + len(run)] == "execute"
    names = [name for _phase, name, _step in JUDGEMENT]
    assert len(set(names)) == len(names)


def test_each_step_refuses_in_table_order(store: SessionStore, tmp_path: Path) -> None:
    limiter = RateLimiter.open(tmp_path, rate_config_from_table(
        {"rules": ["agents.delete=1/min"]}))
    try:
        narrow = principal(store, actions=frozenset({"channel.read"}))
        owner = principal(store)
        assert limiter.take(owner, "agents.delete", NOW) is None  # the one unit is gone
        valid = encode_request(request("agents.delete", target={"pubkey": CHILD}))
        invalid = json.dumps({**json.loads(valid), "args": {}}).encode()

        # Each row: (the step that must answer, its code, the admission then mended).
        state = {"body": invalid, "who": narrow}

        def admission() -> Admission:
            return Admission(principal=state["who"], reading=read_request(state["body"]),
                             policy=HOST, agents=AGENTS, limiter=limiter, now=NOW)

        expected = {
            "validate": (ErrorCode.INVALID_REQUEST, lambda: state.update(body=valid)),
            "authorize": (REFUSALS["action"].code, lambda: state.update(who=owner)),
            "rate_limit": (ErrorCode.UNAUTHORIZED, lambda: limiter.reconfigure(
                rate_config_from_table({}))),
        }
        assert [name for _p, name, _s in JUDGEMENT] == list(expected)
        for _phase, name, _step in JUDGEMENT:
            answer = judge(admission())
            code, mend = expected[name]
            assert isinstance(answer, Verdict) and answer.code is code, (name, answer)
            if name == "authorize":
                assert answer.message == REFUSALS["action"].message
            mend()
        admitted = judge(admission())
        assert isinstance(admitted, Admitted) and admitted.request.action == "agents.delete"
        # What the operation receives: the target authorization resolved, once.
        assert admitted.authorized.target is not None
        assert admitted.authorized.target.pubkey == CHILD
        assert admitted.authorized.target.owner == ME
    finally:
        limiter.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SessionStore]:
    s = SessionStore.open(tmp_path / "sessions")
    yield s
    s.close()
