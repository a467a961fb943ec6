"""The custodian signs an intent exactly when docs/custodian.md's `sign` row allows it:
`intents.check` answers None for every intent `signs` (below) takes, and a fault for
every other, whatever the kind, signer, tags and content.

`signs` states the closed list again on its own, from the `sign` row of the message table
in docs/custodian.md and the events the actions write; it never reads `intents.KINDS`, so
a rule left out there (a tag that may repeat, a role any value, a `p` any key) makes the
two disagree. Each intent is drawn fitting (a kind of the list, its signer from a small
owner graph, its tags within their bounds, each rule's value), then broken in none, one
or two ways: a tag once more than its row allows, one value too few or too many, a tag
of another row or NIP-OA's, a tag dropped, a first value any other, another signer,
another kind (in the list or not), content that is no JSON object.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from custody.custodian import intents
from tests.adversarial import scaled
from tests.custodian.test_messages import FITS, _owner_of

#: Examples for each kind and fault: `make test`, and the long mode
#: (tests/adversarial/__init__.py).
FUZZ = settings(max_examples=scaled(30, 400), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

#: What a tag's first value must be: the signer's recorded owner, or the signer.
OWNER, SELF = "owner", "self"


@dataclass(frozen=True)
class Tag:
    """One tag a kind may carry: how many values follow its name, how often it may appear
    (None: as often as the frame holds), whether it must, and what its first value must be."""

    values: tuple[int, int] = (1, 1)
    times: int | None = 1
    required: bool = True
    first: str | None = None  # OWNER, SELF, or the one literal value


@dataclass(frozen=True)
class Row:
    """One kind of the list. `about`: the tag naming the agent an owner-signed event is
    about (the owner signs it); None: the signer is an agent held here, signing for itself."""

    tags: Mapping[str, Tag] = field(default_factory=dict)
    about: str | None = None
    json_object: bool = False


#: The `sign` row of docs/custodian.md, kind by kind.
LIST: Mapping[int, Row] = {
    0: Row(json_object=True),                                        # profile.set, agents.create
    5: Row({"a": Tag(), "k": Tag(first="30177")}, about="a"),        # agents.delete
    7: Row({"e": Tag(), "h": Tag()}),                                # reaction.add: one channel
    9: Row({"h": Tag(), "e": Tag(values=(1, 3), times=2, required=False),  # root, parent
            "p": Tag(values=(1, 2), times=None, required=False)}),  # mentions
    9000: Row({"h": Tag(), "p": Tag(), "role": Tag(first="bot")}, about="p"),  # put-user
    20001: Row(),                                                    # presence.set
    20002: Row({"h": Tag()}),                                        # typing.set
    24200: Row({"p": Tag(first=OWNER), "agent": Tag(first=SELF),    # observer.emit
                "frame": Tag(first="telemetry")}),
    30174: Row({"d": Tag(), "p": Tag(first=OWNER)}),                 # storage.put (NIP-AE)
    30177: Row({"d": Tag()}, about="d", json_object=True),           # agents.create/update
}


def _json_object(content: str) -> bool:
    try:
        return isinstance(json.loads(content), dict)
    except (ValueError, RecursionError):
        return False


def _agent_named(row: Row, signer: str, first: Mapping[str, tuple[str, ...]]) -> str | None:
    """The agent an owner-signed event names: a deletion's `a` is `30177:<signer>:<agent>`
    with `k` 30177 (a managed-agent record of the signer's), the others' tag its key."""
    assert row.about is not None
    value = first[row.about][0]
    if row.about != "a":
        return value
    parts = value.split(":")
    return parts[2] if len(parts) == 3 and parts[:2] == ["30177", signer] else None


def signs(signer: str, kind: int, tags: tuple[tuple[str, ...], ...], content: str,
          owner_of: Callable[[str], str | None]) -> bool:
    """Whether the custodian may sign this intent, by LIST alone."""
    row = LIST.get(kind)
    if row is None:
        return False
    names = [tag[0] for tag in tags]
    for tag in tags:
        spec = row.tags.get(tag[0])
        if spec is None or not spec.values[0] <= len(tag) - 1 <= spec.values[1]:
            return False
    for name, spec in row.tags.items():
        if spec.required and name not in names:
            return False
        if spec.times is not None and names.count(name) > spec.times:
            return False
    if row.json_object and not _json_object(content):
        return False
    first = {tag[0]: tag[1:] for tag in reversed(tags)}
    if row.about is None:
        if owner_of(signer) is None:
            return False
    else:
        agent = _agent_named(row, signer, first)
        if agent is None or owner_of(agent) != signer:
            return False
    for name, spec in row.tags.items():
        wanted = {OWNER: owner_of(signer), SELF: signer}.get(spec.first or "", spec.first)
        if spec.first is not None and first[name][0] != wanted:
            return False
    return True


# --- the intents drawn --------------------------------------------------------------------
O, O2, A, B, C = "0" * 63 + "1", "0" * 63 + "2", "a" * 64, "b" * 64, "c" * 64
#: Agents held here and their recorded owners: A and B under owners held elsewhere, C under
#: A (so A, an agent, also signs owner rows about C).
GRAPH = {A: O, B: O2, C: A}
KEYS = st.sampled_from([O, O2, A, B, C, A.upper(), ""])
VALUE = st.one_of(
    KEYS,
    st.builds(lambda k, x, y: f"{k}:{x}:{y}", st.sampled_from(["30177", "30174", "0", "30177 "]),
              KEYS, KEYS),
    st.sampled_from(["30177", "telemetry", "bot", "admin", "control", "chan", ""]),
    st.text(max_size=4))
#: Tag names: every row's, NIP-OA's, and a few no row has.
NAMES = st.sampled_from(sorted({n for row in LIST.values() for n in row.tags})
                        + ["auth", "AUTH", "t", "-", ""])
CONTENT = st.sampled_from(["{}", '{"name":"n"}', "[]", "x", "", "null", '{"a":1} x', "1", "{"])


def _first_value(kind: int, name: str, signer: str) -> st.SearchStrategy[str]:
    """The first value a tag of a fitting intent carries: the one its rule wants, if any."""
    spec, row = LIST[kind].tags[name], LIST[kind]
    owned = st.sampled_from(sorted(a for a, o in GRAPH.items() if o == signer) or [B])
    if spec.first is not None:
        return st.just({OWNER: GRAPH.get(signer, O), SELF: signer}.get(spec.first, spec.first))
    if row.about == name:
        return owned.map(lambda agent: f"30177:{signer}:{agent}") if name == "a" else owned
    return VALUE


@st.composite
def _tag(draw: st.DrawFn, kind: int, name: str, signer: str) -> tuple[str, ...]:
    count = draw(st.integers(*LIST[kind].tags[name].values))
    return (name, draw(_first_value(kind, name, signer)), *draw(st.lists(
        VALUE, min_size=count - 1, max_size=count - 1)))


Intent = tuple[str, int, tuple[tuple[str, ...], ...], str]


@st.composite
def _fitting(draw: st.DrawFn, kind: int) -> tuple[str, list[tuple[str, ...]], str]:
    """An intent of `kind` the list allows: its signer, its tags within their bounds."""
    row = LIST[kind]
    signer = draw(st.sampled_from(sorted(GRAPH) if row.about is None
                                  else sorted(set(GRAPH.values()))))
    tags = []
    for name, spec in row.tags.items():
        if spec.required or draw(st.booleans()):
            for _ in range(draw(st.integers(1, spec.times or 3))):
                tags.append(draw(_tag(kind, name, signer)))
    content = '{"name":"n"}' if row.json_object else draw(CONTENT)
    return signer, tags, content


#: Ways an intent breaks a rule (or, by chance, still fits): "none" leaves it fitting.
FAULTS = ("none", "again", "values", "stranger", "dropped", "first", "signer", "kind",
          "content")


@st.composite
def _intent(draw: st.DrawFn, kind: int, fault: str) -> Intent:
    """A fitting intent of `kind` with `fault`, and a fourth of the time one more."""
    signer, tags, content = draw(_fitting(kind))
    fitted, row = kind, LIST[kind]  # the row the tags were drawn for, whatever `kind` becomes
    faults = [fault] + draw(st.sampled_from([[], [], [], [draw(st.sampled_from(FAULTS))]]))
    for fault in faults:
        if fault == "again" and row.tags:  # a tag once more than its row allows
            name = draw(st.sampled_from(sorted(row.tags)))
            times = row.tags[name].times or 3
            while sum(tag[0] == name for tag in tags) <= times:
                tags.append(draw(_tag(fitted, name, signer)))
        elif fault == "values" and tags:  # one value too few or too many
            at = draw(st.integers(0, len(tags) - 1))
            low, high = row.tags[tags[at][0]].values if tags[at][0] in row.tags else (1, 1)
            count = draw(st.sampled_from([low - 1, high + 1]))
            tags[at] = (tags[at] + (draw(VALUE),) * 9)[: count + 1]
        elif fault == "stranger":  # a tag of another row, NIP-OA's, or none's
            tags.append((draw(NAMES), *draw(st.lists(VALUE, max_size=3))))
        elif fault == "dropped" and tags:
            del tags[draw(st.integers(0, len(tags) - 1))]
        elif fault == "first" and tags:  # the first value any other
            at = draw(st.integers(0, len(tags) - 1))
            tags[at] = (tags[at][0], draw(VALUE), *tags[at][2:])
        elif fault == "signer":
            signer = draw(KEYS)
        elif fault == "kind":
            kind = draw(st.sampled_from(sorted(LIST) + [1, 4, 9001, 22242, 30078]))
        elif fault == "content":
            content = draw(CONTENT)
    return signer, kind, tuple(draw(st.permutations(tags))), content


def test_the_statement_signs_what_each_action_writes() -> None:
    """`signs` is no refuse-everything oracle: each kind's intent as its action writes it
    (tests/custodian/test_messages.py FITS) is signed by both."""
    assert FITS.keys() == LIST.keys()
    for kind, (signer, tags, content) in FITS.items():
        assert signs(signer, kind, tags, content, _owner_of), kind
        assert intents.check(signer, kind, tags, content, _owner_of) is None, kind


@pytest.mark.parametrize(("kind", "fault"), [
    pytest.param(kind, fault, id=f"{kind}-{fault}") for kind in LIST for fault in FAULTS])
@FUZZ
@given(data=st.data())
def test_check_signs_exactly_what_the_list_allows(kind: int, fault: str,
                                                  data: st.DataObject) -> None:
    """Kind by kind, fault by fault: each rule of each row is broken on its own."""
    signer, kind, tags, content = data.draw(_intent(kind, fault))
    found = intents.check(signer, kind, tags, content, GRAPH.get)
    allowed = signs(signer, kind, tags, content, GRAPH.get)
    event("signed" if allowed else "refused")
    assert (found is None) == allowed, (found, (signer, kind, tags, content))
