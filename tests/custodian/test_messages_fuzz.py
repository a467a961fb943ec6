"""Row by row, the custodian's message reader (custody/custodian/messages.py) answers a frame
with exactly the `Request` an independent statement of the row gives, or `BadMessage`
where that statement refuses it; never the other, never another exception.

Why beside tests/custodian/test_messages.py: its fuzz mutates bytes, and nearly every
mutant stops at the JSON parse or the version, so a row's member checks were hardly
reached (a review found its structured frames written in another version: refused
before any row was read). Here each frame is built member by member from `ROWS`, this
file's own statement of version 4's table; the reader's table (`messages.OPS`) is never
read but for its names, so a member left unchecked there (a `created_at` of any value, an
`agent` any string, `plaintexts` not decoded) makes the two disagree.

Each member of each row is fuzzed with the rest of its row fitting: a value of another
type, at its bound or one past it, a lone surrogate, a float, NaN, a bool for an integer,
uppercase hex, bad base64, a number past 64 bits; inside a list one item, inside an
object one member (or the object's own faults), recursively. Each row is fuzzed whole:
fitting, its arguments' object with a member added, dropped or written twice, or the
frame around it broken (another version, a member added, dropped or twice, another op).
Every frame is written as UTF-8 or as ASCII-escaped JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from custody.custodian import messages
from custody.custodian.client import decode_reply, request
from tests.adversarial import scaled

#: Examples for each member and each row: `make test`, and the long mode
#: (tests/adversarial/__init__.py).
FUZZ = settings(max_examples=scaled(50, 2000), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

PK = "ab" * 32


class Refused(Exception):
    """The oracle's verdict on a frame: the reader must answer BadMessage."""


@dataclass(frozen=True)
class BigNumber:
    """A JSON integer of `digits` nines, written raw: past 64 bits, and at 4,301 digits past
    what Python's int() takes (json.dumps could not write it)."""

    digits: int


@dataclass(frozen=True)
class Members:
    """A JSON object as written, member by member: a name may come twice."""

    pairs: tuple[tuple[str, object], ...]


def _dump(value: object, ascii_only: bool) -> str:
    if isinstance(value, BigNumber):
        return "9" * value.digits
    if isinstance(value, Members):
        return "{" + ",".join(json.dumps(k, ensure_ascii=ascii_only) + ":" + _dump(v, ascii_only)
                              for k, v in value.pairs) + "}"
    if isinstance(value, dict):
        return _dump(Members(tuple(value.items())), ascii_only)
    if isinstance(value, list):
        return "[" + ",".join(_dump(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only, allow_nan=True)


def _pairs(value: object) -> tuple[tuple[str, object], ...] | None:
    if isinstance(value, Members):
        return value.pairs
    if isinstance(value, dict):
        return tuple(value.items())
    return None


#: Any JSON value, mostly of a type no member takes: floats, NaN and infinities, numbers
#: past 64 bits, nested lists and objects, and a few that do fit some member.
OTHERS = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
    | st.sampled_from([PK, PK.upper(), 0, 1, "true", "3"])
    | st.builds(BigNumber, st.sampled_from([21, 4_301])),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)


class Kind(Protocol):
    """What one member is: values that fit, values that may not, and the verdict."""

    def fitting(self) -> st.SearchStrategy[object]: ...

    def hostile(self) -> st.SearchStrategy[object]: ...

    def expect(self, value: object) -> object:
        """The value the reader hands on for `value`, or Refused."""


_HEX = "0123456789abcdef"


@dataclass(frozen=True)
class Hex:
    """A public key: 64 lowercase hex digits."""

    def fitting(self) -> st.SearchStrategy[object]:
        return st.text(_HEX, min_size=64, max_size=64)

    def hostile(self) -> st.SearchStrategy[object]:
        return st.sampled_from([
            PK.upper(), PK[:-1], PK + "0", PK[:-1] + "\u0661", PK[:-1] + "g", " " + PK[1:],
            PK[:-1] + "\ud800", "", "0x" + PK[2:],
        ]) | st.text(max_size=70) | OTHERS

    def expect(self, value: object) -> object:
        if type(value) is not str or len(value) != 64 or not set(value) <= set(_HEX):
            raise Refused
        return value


@dataclass(frozen=True)
class Text:
    """A string of at most `limit` characters (code points), none a lone surrogate."""

    limit: int

    def fitting(self) -> st.SearchStrategy[object]:
        return st.text(max_size=12) | st.sampled_from(
            ["", "\x00", "\u2028", "\ufeff", "\U0001f600", "9" * 40])

    def hostile(self) -> st.SearchStrategy[object]:
        edges = [self.limit, self.limit + 1]
        astral = (st.sampled_from(edges).map(lambda n: "\U0001f600" * n)  # 12 bytes escaped
                  if self.limit <= 2048 else st.nothing())
        lone = st.builds(lambda text, s: text + s, st.text(max_size=5),
                         st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "x\ud83d"]))
        return st.sampled_from(edges).map(lambda n: "a" * n) | astral | lone | OTHERS

    def expect(self, value: object) -> object:
        if (type(value) is not str or len(value) > self.limit
                or any(0xD800 <= ord(c) <= 0xDFFF for c in value)):
            raise Refused
        return value


@dataclass(frozen=True)
class Int:
    """An integer in low..high; a bool is no integer here."""

    low: int
    high: int

    def fitting(self) -> st.SearchStrategy[object]:
        return st.integers(self.low, self.high)

    def hostile(self) -> st.SearchStrategy[object]:
        return st.sampled_from([
            self.low, self.high, self.low - 1, self.high + 1, True, False, 2**63, -2**63,
            2**64, -2**64, 1.0, 1.5, -0.0, float("nan"), float("inf"), str(self.low), None,
        ]) | st.builds(BigNumber, st.sampled_from([21, 4_301])) | OTHERS

    def expect(self, value: object) -> object:
        if type(value) is not int or not self.low <= value <= self.high:
            raise Refused
        return value


@dataclass(frozen=True)
class Bool:
    def fitting(self) -> st.SearchStrategy[object]:
        return st.booleans()

    def hostile(self) -> st.SearchStrategy[object]:
        return st.sampled_from([0, 1, "true", "false", None, 1.0]) | OTHERS

    def expect(self, value: object) -> object:
        if type(value) is not bool:
            raise Refused
        return value


_BASE64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


@dataclass(frozen=True)
class Base64:
    """Standard base64, padded, no other character; decoded to bytes (non-zero bits past
    the last byte are dropped, as a lenient decoder drops them)."""

    def fitting(self) -> st.SearchStrategy[object]:
        return st.binary(max_size=24).map(messages.b64)

    def hostile(self) -> st.SearchStrategy[object]:
        return st.sampled_from([
            "QR==", "QQ", "QQ=", "====", "QQ===", "Q===", "QQ==QQ==", "QQ=A", "=QQ=", "-_-_",
            "QQ=\n", "Q Q==", "QUJ\u0661", "QUJD\n", "not base64!",
        ]) | st.text(_BASE64 + "=-_ \n", max_size=12) | OTHERS

    def expect(self, value: object) -> object:
        if type(value) is not str:
            raise Refused
        data = value.rstrip("=")
        if len(value) % 4 or len(value) - len(data) > 2 or not set(data) <= set(_BASE64):
            raise Refused
        bits = "".join(f"{_BASE64.index(c):06b}" for c in data)
        return bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits) - 7, 8))


@dataclass(frozen=True)
class Nullable:
    inner: Kind

    def fitting(self) -> st.SearchStrategy[object]:
        return st.none() | self.inner.fitting()

    def hostile(self) -> st.SearchStrategy[object]:
        return self.inner.hostile()

    def expect(self, value: object) -> object:
        return None if value is None else self.inner.expect(value)


#: Lists past this many items are not built one past their bound here (a backup's 65,537
#: names: test_a_list_past_the_most_names_is_refused).
_REPEAT_AT_MOST = 300


@dataclass(frozen=True)
class ListOf:
    """A JSON array of low..high items, each an `inner`; handed on as a tuple."""

    inner: Kind
    low: int
    high: int

    def fitting(self) -> st.SearchStrategy[object]:
        return st.lists(self.inner.fitting(), min_size=self.low,
                        max_size=max(self.low, min(self.high, 3)))

    def hostile(self) -> st.SearchStrategy[object]:
        one_bad = st.builds(lambda items, at, bad: items[:at] + [bad] + items[at:],
                            self.fitting(), st.integers(0, 3), self.inner.hostile())
        counts = [n for n in (self.low - 1, self.high, self.high + 1)
                  if 0 <= n and self.high <= _REPEAT_AT_MOST]
        repeated = (st.builds(lambda item, n: [item] * n, self.inner.fitting(),
                              st.sampled_from(counts)) if counts else st.nothing())
        return st.one_of(one_bad, one_bad, one_bad, repeated, OTHERS)  # mostly an item's fault

    def expect(self, value: object) -> object:
        if type(value) is not list or not self.low <= len(value) <= self.high:
            raise Refused
        return tuple(self.inner.expect(item) for item in value)


#: Names a row does not have, some of them another row's or the frame's.
_STRANGERS = st.sampled_from(["secret", "v", "op", "args", "", "x", "Pubkey", "pubkey "]) | st.text(
    max_size=6)


@dataclass(frozen=True)
class Obj:
    """A JSON object with exactly these members, each once."""

    members: Mapping[str, Kind]

    def fitting(self) -> st.SearchStrategy[Members]:
        names = sorted(self.members)
        return st.permutations(names).flatmap(lambda order: st.tuples(
            *(st.tuples(st.just(n), self.members[n].fitting()) for n in order))).map(Members)

    def member_fault(self, name: str) -> st.SearchStrategy[Members]:
        """The members fitting but `name`, which may not."""
        return st.tuples(self.fitting(), self.members[name].hostile()).map(
            lambda f: Members(tuple((n, f[1] if n == name else v) for n, v in f[0].pairs)))

    def object_faults(self) -> st.SearchStrategy[object]:
        """The object itself broken: a member added, dropped or written twice, or no object."""
        faults = [st.tuples(self.fitting(), _STRANGERS, OTHERS | st.none()).map(
            lambda f: Members(f[0].pairs + ((f[1], f[2]),)))]
        if self.members:
            names = st.sampled_from(sorted(self.members))
            faults += [
                st.tuples(self.fitting(), names).map(
                    lambda f: Members(tuple((n, v) for n, v in f[0].pairs if n != f[1]))),
                st.tuples(self.fitting(), names, st.booleans()).flatmap(
                    lambda f: (self.members[f[1]].fitting() if f[2]
                               else self.members[f[1]].hostile()).map(
                        lambda again: Members(f[0].pairs + ((f[1], again),)))),
            ]
        return st.one_of(*faults, OTHERS)

    def hostile(self) -> st.SearchStrategy[object]:
        """Mostly one member's own fault (what the row's checks see), else the object's."""
        members = [self.member_fault(name) for name in sorted(self.members)]
        return st.one_of(*members, *members, self.object_faults())

    def expect(self, value: object) -> object:
        pairs = _pairs(value)
        if pairs is None:
            raise Refused
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names) or set(names) != set(self.members):
            raise Refused
        return {n: self.members[n].expect(v) for n, v in pairs}


# --- version 4's table, restated ---------------------------------------------------------
#: The version whose rows ROWS states: a row that changes changes VERSION (messages.py's
#: rule), and then this statement with it.
ROWS_VERSION = 4
#: Characters of an event's content and of each tag value: 1 MiB.
_CONTENT = 1024 * 1024
_TIME = Int(0, 2**40)
_AUTH_TAG = ListOf(Text(1024), 4, 4)
_INTENT = Obj({"signer": Hex(), "kind": Int(0, 65535), "created_at": _TIME,
               "tags": ListOf(ListOf(Text(_CONTENT), 1, 8), 0, 64), "content": Text(_CONTENT)})
_NAME = Obj({"pubkey": Hex(), "name": Text(256), "creator": Nullable(Hex())})

#: op -> its arguments: the table of docs/custodian.md ("What it answers"), with the bounds
#: of messages.py's constants as their comments give them (256 events: the signing batch;
#: 256 payloads; 64 tags of 1..8 values; 256 bytes of secret text; 65,536 names).
ROWS: Mapping[str, Obj] = {
    "records_version": Obj({}),
    "agent": Obj({"pubkey": Hex(), "include_deleted": Bool()}),
    "agents": Obj({"include_deleted": Bool()}),
    "chain": Obj({"pubkey": Hex()}),
    "relay": Obj({}),
    "token": Obj({}),
    "mint": Obj({"owner": Hex(), "mint_ref": Nullable(Text(512))}),
    "import": Obj({"secret_bytes": Int(1, 256), "owner": Hex(), "auth_tag": Nullable(_AUTH_TAG)}),
    "destroy": Obj({"pubkey": Hex()}),
    "attach_auth": Obj({"pubkey": Hex(), "tag": _AUTH_TAG}),
    "sign": Obj({"events": ListOf(_INTENT, 1, 256)}),
    "sign_auth": Obj({"agent": Hex(), "relay_url": Text(2048), "challenge": Text(1024),
                      "created_at": _TIME}),
    "memory_address": Obj({"agent": Hex(), "slug": Text(1024)}),
    "encrypt": Obj({"agent": Hex(), "peer": Hex(), "plaintexts": ListOf(Base64(), 0, 256)}),
    "decrypt": Obj({"agent": Hex(), "peer": Hex(), "payloads": ListOf(Text(200_000), 0, 256)}),
    "backup": Obj({"names": ListOf(_NAME, 0, 65_536)}),
}


def _expect_request(frame: object) -> tuple[str, object]:
    """(op, args) the reader must give for `frame`, or Refused."""
    pairs = _pairs(frame)
    if pairs is None:
        raise Refused
    names = [n for n, _ in pairs]
    if sorted(names) != ["args", "op", "v"]:
        raise Refused
    top = dict(pairs)
    if type(top["v"]) is not int or top["v"] != ROWS_VERSION:
        raise Refused
    op = top["op"]
    if type(op) is not str or op not in ROWS:
        raise Refused
    return op, ROWS[op].expect(top["args"])


def _frame(op: str, args: object) -> Members:
    return Members((("v", messages.VERSION), ("op", op), ("args", args)))


def _member_faults(op: str, member: str) -> st.SearchStrategy[Members]:
    """A request for `op` whose arguments fit but for `member`, which may not."""
    return ROWS[op].member_fault(member).map(lambda args: _frame(op, args))


@st.composite
def _row_faults(draw: st.DrawFn, op: str) -> Members:
    """A request for `op`: all fitting (a third), its arguments' object broken (a member
    added, dropped or written twice; not an object: a third), or the frame around them (a
    third): another version, a member added, dropped or twice, another op."""
    row = ROWS[op]
    where = draw(st.integers(0, 2))
    args = draw(row.object_faults() if where == 1 else row.fitting())
    pairs = list(_frame(op, args).pairs)
    if where == 2:
        fault = draw(st.sampled_from(["version", "added", "dropped", "twice", "op"]))
        at = draw(st.integers(0, 2))
        if fault == "version":
            pairs[0] = ("v", draw(st.sampled_from(
                [messages.VERSION - 1, messages.VERSION + 1, str(messages.VERSION), True,
                 float(messages.VERSION), None, BigNumber(21)])))
        elif fault == "added":
            pairs.append((draw(_STRANGERS), draw(OTHERS)))
        elif fault == "dropped":
            del pairs[at]
        elif fault == "twice":
            pairs.append((pairs[at][0], draw(st.sampled_from([pairs[at][1], "relay", {}]))))
        else:
            pairs[1] = ("op", draw(st.sampled_from([op.upper(), op + " ", "", "Sign", None, 1])))
    return Members(tuple(draw(st.permutations(pairs))))


def _same(got: object, want: object) -> bool:
    """Equal, and of the same types all the way down (a list is no tuple, True is no 1)."""
    if type(got) is not type(want):
        return False
    if isinstance(want, dict):
        assert isinstance(got, dict)
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, tuple):
        assert isinstance(got, tuple)
        return len(got) == len(want) and all(map(_same, got, want))
    return bool(got == want)


def test_rows_restates_this_version_of_the_table() -> None:
    """ROWS is version 4's table: once VERSION moves on, a row changed, and so must ROWS."""
    assert messages.VERSION == ROWS_VERSION
    assert ROWS.keys() == messages.OPS.keys()
    for op, row in ROWS.items():
        assert row.members.keys() == messages.OPS[op].keys(), op


def _reads_as_stated(frame: Members, ascii_only: bool) -> None:
    """The reader's answer to `frame` is the one its row states."""
    body = _dump(frame, ascii_only).encode("utf-8", "surrogatepass")
    try:
        want: tuple[str, object] | None = _expect_request(frame)
    except Refused:
        want = None
    try:
        got = messages.decode_request(body)
    except messages.BadMessage:
        assert want is None, f"refused, but the row takes it: {body[:300]!r}"
        return
    assert want is not None, f"a Request, but the row refuses it: {got!r:.300}"
    assert got.op == want[0] and _same(dict(got.args), want[1]), (got, want)


@pytest.mark.parametrize(("op", "member"), [
    pytest.param(op, member, id=f"{op}.{member}")
    for op, row in ROWS.items() for member in row.members])
@FUZZ
@given(data=st.data())
def test_each_member_reads_exactly_what_its_row_states(op: str, member: str,
                                                       data: st.DataObject) -> None:
    """The rest of the row fitting, so what refuses a frame is this member's own check."""
    _reads_as_stated(data.draw(_member_faults(op, member)), data.draw(st.booleans()))


@pytest.mark.parametrize("op", sorted(ROWS))
@FUZZ
@given(data=st.data())
def test_each_row_reads_exactly_what_it_states(op: str, data: st.DataObject) -> None:
    _reads_as_stated(data.draw(_row_faults(op)), data.draw(st.booleans()))


def test_a_list_past_the_most_names_is_refused() -> None:
    """The one list too long to build one past its bound in every fuzzed example."""
    name = {"pubkey": PK, "name": "n", "creator": None}
    for count, refused in ((65_536, False), (65_537, True)):
        body = request("backup", names=[name] * count)[messages.HEADER.size:]
        if refused:
            with pytest.raises(messages.BadMessage):
                messages.decode_request(body)
        else:
            assert len(messages.decode_request(body).args["names"]) == count  # type: ignore[arg-type]


#: Codes an error answer may carry: docs/custodian.md's list, restated.
_CODES = ("bad_message", "unknown_agent", "unseal_failed", "custody", "invalid", "refused",
          "rate_limited", "internal")


def _no_number_past_the_table(value: object) -> bool:
    """No float, NaN, infinity or integer literal past 20 characters anywhere in `value`."""
    if isinstance(value, (float, BigNumber)):
        return False
    if isinstance(value, int) and not isinstance(value, bool):
        return len(str(value)) <= 20
    if isinstance(value, list):
        return all(map(_no_number_past_the_table, value))
    if isinstance(value, dict):
        return all(map(_no_number_past_the_table, value.values()))
    return True


@FUZZ
@given(value=OTHERS, key=st.sampled_from(["ok", "error", "x"]), extra=st.booleans(),
       code=st.sampled_from([*_CODES, "ok", "", "BAD_MESSAGE"]),
       message=st.sampled_from(["m", "", None, 1]))
def test_every_reply_is_an_answer_of_the_table_or_bad_message(
        value: object, key: str, extra: bool, code: str, message: object) -> None:
    if key == "error" and value is None:
        value = {"code": code, "message": message}
    frame = {"v": messages.VERSION, key: value, **({"z": 1} if extra else {})}
    body = _dump(frame, True).encode()
    parses = _no_number_past_the_table(value)
    want: tuple[bool, object] | None = None
    if parses and not extra and key == "ok":
        want = (True, value)
    elif (parses and not extra and key == "error" and isinstance(value, dict)
          and value.keys() == {"code", "message"} and value["code"] in _CODES
          and type(value["message"]) is str):
        want = (False, (value["code"], value["message"]))
    try:
        got = decode_reply(body)
    except messages.BadMessage:
        assert want is None, body[:300]
        return
    assert want is not None and got == want, (got, want)
