"""The custodian's message reader (custody/custodian/messages.py): every frame is a `Request` that
fits its row or one `BadMessage`, never another exception, whatever the bytes (fuzzed),
and every row round-trips."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buzzwire import jsonvalues as _jsonvalues
from buzzwire import kinds
from custody.custodian import intents, messages
from custody.custodian.client import decode_reply, request

PK = "ab" * 32

#: One well-formed request per row of the table: the fuzzing starts from these.
GOOD: dict[str, dict[str, object]] = {
    "records_version": {},
    "agent": {"pubkey": PK, "include_deleted": False},
    "agents": {"include_deleted": True},
    "chain": {"pubkey": PK},
    "relay": {},
    "token": {},
    "mint": {"owner": PK, "mint_ref": None},
    "import": {"secret_bytes": 64, "owner": PK, "auth_tag": None},
    "destroy": {"pubkey": PK},
    "attach_auth": {"pubkey": PK, "tag": ["auth", PK, "", "00"]},
    "sign": {"events": [{"signer": PK, "kind": 9, "created_at": 1, "tags": [["h", "c"]],
                         "content": "x"}]},
    "sign_auth": {"agent": PK, "relay_url": "wss://r", "challenge": "c", "created_at": 1},
    "memory_address": {"agent": PK, "slug": "core"},
    "encrypt": {"agent": PK, "peer": PK, "plaintexts": [messages.b64(b"x")]},
    "decrypt": {"agent": PK, "peer": PK, "payloads": ["AgAA"]},
    "backup": {"names": [{"pubkey": PK, "name": "scout", "creator": None}]},
}


def test_every_row_has_a_good_example_and_it_parses() -> None:
    assert GOOD.keys() == messages.OPS.keys()
    for op, args in GOOD.items():
        frame = request(op, **args)
        body = frame[messages.HEADER.size:]
        assert messages.frame_length(frame[:4]) == len(body)
        assert messages.decode_request(body).op == op


#: A request's opening in the table's own version: with a literal, each frame below would
#: be refused for its version alone once VERSION moved on, whatever else it breaks.
_V = b'{"v":%d,' % messages.VERSION


@pytest.mark.parametrize("body", [
    b"", b"[]", b"{}", b"\xff", _V + b'"op":"sign","args":{}}',
    b'{"v":%d,"op":"records_version","args":{}}' % (messages.VERSION - 1),  # the version before
    b'{"v":true,"op":"records_version","args":{}}',
    _V + b'"op":"records_version","args":{},"x":1}',
    _V + b'"op":"records_version","op":"agents","args":{}}',
    _V + b'"op":"agent","args":{"pubkey":"' + PK.encode() + b'","include_deleted":0}}',
    _V + b'"op":"sign_auth","args":{"agent":"' + PK.encode()
    + b'","relay_url":"r","challenge":"c","created_at":1.5}}',
    _V + b'"op":"memory_address","args":{"agent":"' + PK.upper().encode()
    + b'","slug":"s"}}',
    _V + b'"op":"encrypt","args":{"agent":"' + PK.encode() + b'","peer":"' + PK.encode()
    + b'","plaintexts":["not base64!"]}}',
    b'{"v":NaN}', b"[" * 100_000,
])
def test_a_frame_that_breaks_the_table_is_bad_message(body: bytes) -> None:
    with pytest.raises(messages.BadMessage):
        messages.decode_request(body)


@pytest.mark.parametrize("digits", [21, 4_301, 100_000])
def test_a_number_past_64_bits_is_named_as_such(digits: int) -> None:
    body = json.dumps({"v": messages.VERSION, "op": "sign_auth",
                       "args": {**GOOD["sign_auth"], "created_at": "@"}})
    body = body.replace('"@"', "9" * digits)
    with pytest.raises(messages.BadMessage, match="a number past 64 bits"):
        messages.decode_request(body.encode())


@pytest.mark.parametrize(("escaped", "text"), [
    ("\\ud800", False), ("\\udfff", False), ("x\\ud83d", False), ("\\ude00\\ud83d", False),
    ("\\ud83d\\ude00", True),  # a pair: one astral character, which is text
])
def test_a_lone_surrogate_is_bad_message_a_pair_is_text(escaped: str, text: bool) -> None:
    for op, member in (("memory_address", "slug"), ("mint", "mint_ref")):
        args = json.dumps({**GOOD[op], member: "@"}).replace("@", escaped)
        body = f'{{"v":{messages.VERSION},"op":"{op}","args":{args}}}'.encode("ascii")
        if text:
            assert messages.decode_request(body).args[member] == "\U0001f600"
        else:
            with pytest.raises(messages.BadMessage, match="surrogate"):
                messages.decode_request(body)


@pytest.mark.parametrize(("escaped", "text"), [
    ("\\ud800", False), ("x\\udfff", False), ("\\ude00\\ud83d", False),
    ("\\ud83d\\ude00", True),
])
def test_an_answer_holding_a_lone_surrogate_is_bad_message_a_pair_is_text(
        escaped: str, text: bool) -> None:
    """The same rule as a request's, in an `ok` value, where no row types the strings:
    at the top, deep in a list or object, and as a member name (the daemon writes these
    answers to agents as UTF-8, where a lone surrogate would raise UnicodeEncodeError)."""
    for ok in ('"@"', '{"address":["a","@"]}', '{"@":1}'):
        body = f'{{"v":{messages.VERSION},"ok":{ok.replace("@", escaped)}}}'.encode("ascii")
        if text:
            assert "\U0001f600" in json.dumps(decode_reply(body), ensure_ascii=False)
        else:
            with pytest.raises(messages.BadMessage, match="surrogate"):
                decode_reply(body)


def test_values_are_bounded_before_the_parse_and_counted_outside_strings() -> None:
    """MAX_VALUES: the largest request (a backup of MAX_BACKUP_NAMES names) parses; one more
    value than the bound is refused unparsed; `,:[{` inside strings are not values."""
    names = [{"pubkey": PK, "name": "n", "creator": None}] * messages.MAX_BACKUP_NAMES
    largest = request("backup", names=names)[messages.HEADER.size:]
    assert len(messages.decode_request(largest).args["names"]) == messages.MAX_BACKUP_NAMES  # type: ignore[arg-type]
    over = b'{"v":3,"op":"sign","args":{"events":[' + b"0," * messages.MAX_VALUES + b"0]}}"
    with pytest.raises(messages.BadMessage, match="values in one frame"):
        messages.decode_request(over)
    content = ",:[{" * (messages.MAX_VALUES // 2)  # 2 * MAX_VALUES of them, in one string
    event = {"signer": PK, "kind": 9, "created_at": 1, "tags": [["h", "c"]], "content": content}
    body = request("sign", events=[event, event, event])[messages.HEADER.size:]
    assert messages.decode_request(body).args["events"][2]["content"] == content  # type: ignore[index]


def test_strings_never_closed_are_counted_in_one_pass() -> None:
    """The recount outside strings is linear in the frame: a string never closed runs to the
    end (a lone backslash last included), so no match is tried again from every later quote.
    A review's frame of unclosed strings past MAX_VALUES held the event loop for minutes
    (quadratic: each of its quotes scanned the rest of the frame)."""
    for literal in (b'"\\"\\"abc', b'"abc\\', b'"', b'"\\'):
        assert _jsonvalues._TOKEN.fullmatch(literal), literal
    frame = b'"' + b'\\"' * 200_000 + b"," * (messages.MAX_VALUES + 1)
    with pytest.raises(messages.BadMessage, match="not UTF-8 JSON"):
        messages.decode_request(frame)


def test_the_recount_holds_no_copy_of_the_frame() -> None:
    """Past the bound the values are counted again one match at a time: a `sub` without the
    strings held about 170 bytes a string (a 24 MiB frame of empty strings, 1.4 GiB)."""
    import tracemalloc

    quoted = b'"' + b"," * (messages.MAX_VALUES + 1) + b'"'  # past the raw count's bound
    frame = quoted + b'""' * 1_000_000  # and a million strings more: 2 MB
    tracemalloc.start()
    try:
        with pytest.raises(messages.BadMessage, match="values in one frame"):
            messages.decode_request(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024, peak  # the old recount: about 170 MB


def test_a_secret_never_rides_in_the_json() -> None:
    """import's secret follows the frame (messages.TAILS); a `secret` member is refused."""
    from custody._files import MAX_SECRET_TEXT

    assert messages.TAILS == {"import": "secret_bytes"}
    assert messages.MAX_SECRET_BYTES == MAX_SECRET_TEXT
    for args in ({"secret": "00" * 32, "owner": PK, "auth_tag": None},
                 {"secret_bytes": 64, "secret": "00" * 32, "owner": PK, "auth_tag": None},
                 {"secret_bytes": 0, "owner": PK, "auth_tag": None},
                 {"secret_bytes": MAX_SECRET_TEXT + 1, "owner": PK, "auth_tag": None}):
        with pytest.raises(messages.BadMessage):
            messages.decode_request(request("import", **args)[messages.HEADER.size:])


def test_a_length_over_the_bound_is_refused_before_the_body() -> None:
    with pytest.raises(messages.BadMessage):
        messages.frame_length(messages.HEADER.pack(messages.MAX_FRAME + 1))


def test_each_decoder_bounds_a_body_handed_to_it_whole() -> None:
    """The length is checked at the header (`frame_length`), and again by each decoder: a
    body handed to one whole, however it was read, is not parsed past MAX_FRAME."""
    for decode, key in ((decode_reply, b'"ok"'), (messages.decode_request, b'"x"')):
        body = b'{"v":3,' + key + b':"' + b"x" * messages.MAX_FRAME + b'"}'
        with pytest.raises(messages.BadMessage, match="frame over the bound"):
            decode(body)


def test_an_error_answer_carries_a_code_of_the_table() -> None:
    """The client maps each of ERROR_CODES to one exception: an answer with any other code
    is no answer of the table (BadMessage), not an error the client would have to guess."""
    for code in messages.ERROR_CODES:
        frame = messages.reply_error(code, "m")
        assert decode_reply(frame[messages.HEADER.size:]) == (False, (code, "m"))
    for code in ("ok", "", "BAD_MESSAGE", "refused ", "timeout"):
        body = json.dumps({"v": messages.VERSION, "error": {"code": code, "message": "m"}})
        with pytest.raises(messages.BadMessage, match="not an answer of the table"):
            decode_reply(body.encode())


def _mutations() -> st.SearchStrategy[bytes]:
    goods = [json.dumps({"v": messages.VERSION, "op": op, "args": args}).encode() for op, args in GOOD.items()]
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=70) | st.floats(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                    max_size=4),
        max_leaves=12)

    @st.composite
    def mutated(draw: st.DrawFn) -> bytes:
        base = bytearray(draw(st.sampled_from(goods)))
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(base)))
            action = draw(st.integers(0, 2))
            if action == 0 and at < len(base):
                base[at] = draw(st.integers(0, 255))
            elif action == 1:
                base[at:at] = draw(st.binary(max_size=8))
            else:
                del base[at:at + draw(st.integers(1, 8))]
        return bytes(base)

    def with_args(args: object) -> bytes:
        # The table's own version: any other stops every frame at "not a version N message"
        # before the row is read (the fuzz of each row: tests/custodian/test_messages_fuzz.py).
        return json.dumps({"v": messages.VERSION, "op": "sign", "args": args}).encode()

    return st.binary(max_size=300) | mutated() | json_values.map(
        lambda v: json.dumps(v).encode()) | json_values.map(with_args)


@settings(max_examples=400, deadline=None)
@given(_mutations())
def test_the_reader_answers_every_input_with_a_request_or_bad_message(body: bytes) -> None:
    try:
        request = messages.decode_request(body)
    except messages.BadMessage:
        return
    assert request.op in messages.OPS
    assert request.args.keys() == messages.OPS[request.op].keys()


def test_the_kind_list_is_the_kinds_the_actions_publish() -> None:
    from buzzwire.contract import ACTIONS

    published = {spec.published_kind for spec in ACTIONS.values()} - {None}
    # 5, 9000
    # and 30177 are what agents.create/update/delete sign (daemon/operations/_managed.py).
    assert published <= intents.KINDS.keys()
    assert intents.KINDS.keys() - published == {5, 9000, 30177}
    assert 22242 not in intents.KINDS


def test_each_shape_is_only_what_its_action_writes() -> None:
    """Beyond the kinds, the shapes: what reaction.add, message.reply, observer.emit and
    agents.create/update write, and nothing more a relay or a client might read as
    something else (a reaction in two channels, an agent-signed `control` frame)."""
    from buzzwire import kinds

    owner, agent, target = "a" * 64, "b" * 64, "c" * 64

    def owner_of(pubkey: str) -> str | None:
        return {agent: owner}.get(pubkey)

    def fault(signer: str, kind: int, *tags: tuple[str, ...], content: str = "") -> str | None:
        return intents.check(signer, kind, tags, content, owner_of)

    reaction = (("e", target), ("h", "chan"))
    assert fault(agent, kinds.REACTION, *reaction, content="+") is None
    assert fault(agent, kinds.REACTION, *reaction, ("h", "other")) == "kind 7: tag 'h' twice"
    assert fault(agent, kinds.REACTION, ("e", target)) == "kind 7 needs the tags ['h']"
    for extra in (("p", owner), ("k", "9")):
        assert fault(agent, kinds.REACTION, *reaction, extra) is not None, extra
    thread = (("e", target, "", "root"), ("e", target, "", "reply"))
    mentions = [("p", f"{n:064x}") for n in range(50)]
    assert fault(agent, kinds.STREAM_MESSAGE, ("h", "chan"), *thread, *mentions) is None
    assert fault(agent, kinds.STREAM_MESSAGE, ("h", "chan"), *thread, ("e", target)) == (
        "kind 9: tag 'e' 3 times")
    frame = (("p", owner), ("agent", agent))
    assert fault(agent, kinds.OBSERVER_FRAME, *frame, ("frame", "telemetry")) is None
    assert fault(agent, kinds.OBSERVER_FRAME, *frame, ("frame", "control")) == (
        "kind 24200: tag 'frame' must be 'telemetry'")
    assert fault(owner, kinds.MANAGED_AGENT, ("d", agent), content='{"name":"n"}') is None
    assert fault(owner, kinds.MANAGED_AGENT, ("d", agent), content="not json") == (
        "kind 30177: content is not a JSON object")


def test_a_put_user_gives_only_the_role_agents_create_gives() -> None:
    """9000 is signed with the owner's key: with any role, a compromised pipeline could make
    the owner grant its agent `admin` in any group. Only `bot`, once, as agents.create sends."""
    from buzzwire import kinds

    owner, agent = "a" * 64, "b" * 64

    def owner_of(pubkey: str) -> str | None:
        return {agent: owner, owner: None}.get(pubkey)

    def fault(*role: tuple[str, ...]) -> str | None:
        return intents.check(owner, 9000, (("h", "chan"), ("p", agent), *role), "", owner_of)

    assert fault(("role", kinds.PUT_USER_ROLE)) is None
    assert fault(("role", "admin")) == "kind 9000: tag 'role' must be 'bot'"
    assert fault(("role", "bot"), ("role", "owner")) == "kind 9000: tag 'role' twice"
    assert fault() == "kind 9000 needs the tags ['role']"


OWNER, AGENT, OTHER = "a" * 64, "b" * 64, "c" * 64

#: One intent per row of `intents.KINDS` that fits it, (signer, tags, content), signed as
#: its action signs it: AGENT is a live agent held here, recorded under OWNER.
FITS: dict[int, tuple[str, tuple[tuple[str, ...], ...], str]] = {
    kinds.METADATA: (AGENT, (), '{"name":"n"}'),
    kinds.DELETION: (OWNER, (("a", f"{kinds.MANAGED_AGENT}:{OWNER}:{AGENT}"),
                             ("k", str(kinds.MANAGED_AGENT))), ""),
    kinds.REACTION: (AGENT, (("e", OTHER), ("h", "chan")), "+"),
    kinds.STREAM_MESSAGE: (AGENT, (("h", "chan"), ("e", OTHER, "", "root"), ("p", OTHER)), "hi"),
    kinds.PUT_USER: (OWNER, (("h", "chan"), ("p", AGENT), ("role", kinds.PUT_USER_ROLE)), ""),
    kinds.PRESENCE: (AGENT, (), "online"),
    kinds.TYPING: (AGENT, (("h", "chan"),), ""),
    kinds.OBSERVER_FRAME: (AGENT, (("p", OWNER), ("agent", AGENT), ("frame", "telemetry")), "x"),
    kinds.MEMORY: (AGENT, (("d", "f" * 64), ("p", OWNER)), "sealed"),
    kinds.MANAGED_AGENT: (OWNER, (("d", AGENT),), '{"name":"n"}'),
}


def _owner_of(pubkey: str) -> str | None:
    return {AGENT: OWNER}.get(pubkey)


def _fault(kind: int, tags: tuple[tuple[str, ...], ...], content: str | None = None) -> str | None:
    """`intents.check` of FITS[kind] with `tags` (and `content`) in its place."""
    signer, _, fitting = FITS[kind]
    return intents.check(signer, kind, tags, fitting if content is None else content, _owner_of)


def _with_values(kind: int, name: str, count: int) -> tuple[tuple[str, ...], ...]:
    """FITS[kind]'s tags with one `name` tag of `count` values (its fitting ones first)."""
    fitting = FITS[kind][1]
    given = next((tag[1:] for tag in fitting if tag[0] == name), ())
    values = (given + ("x",) * count)[:count]
    return ((name, *values), *(tag for tag in fitting if tag[0] != name))


def test_every_row_has_an_intent_that_fits_it() -> None:
    assert FITS.keys() == intents.KINDS.keys()
    for kind, (_, tags, _) in FITS.items():
        assert _fault(kind, tags) is None, kind


def test_every_tag_holds_only_its_rows_number_of_values() -> None:
    """Each row's (fewest, most) values after a tag's name, one past each side refused by
    that rule. NIP-29 reads a put-user's roles from the `p` tag's values after the pubkey:
    `["p", agent, "admin"]` under the owner's key would make its agent an admin of the group
    although the `role` tag says `bot`."""
    assert _fault(kinds.PUT_USER, (("h", "chan"), ("p", AGENT, "admin"),
                                   ("role", kinds.PUT_USER_ROLE))) == (
        "kind 9000: tag 'p' has 2 values")
    for kind, shape in intents.KINDS.items():
        for name, (fewest, most) in shape.tags.items():
            for count in {fewest - 1, most + 1} - {-1}:
                assert _fault(kind, _with_values(kind, name, count)) == (
                    f"kind {kind}: tag {name!r} has {count} values"), (kind, name, count)
            for count in (fewest, most):  # and at each bound, no count refusal
                assert _fault(kind, _with_values(kind, name, count)) != (
                    f"kind {kind}: tag {name!r} has {count} values"), (kind, name, count)


def test_a_deletion_names_only_the_signers_own_30177_of_its_agent() -> None:
    """Kind 5 is signed with the owner's key: its `a` coordinate must be a managed-agent
    record (30177) of the signer's own, about an agent recorded under it, and its `k` must
    say 30177 too: the owner's key signs no deletion of any other record."""
    record = str(kinds.MANAGED_AGENT)
    refusal = "kind 5 is signed only by the recorded owner of the agent it names"
    for a, k in ((f"{record}:{OTHER}:{AGENT}", record),          # another author's record
                 (f"{kinds.MEMORY}:{OWNER}:{AGENT}", record),    # not a managed-agent record
                 (f"{record}:{OWNER}:{AGENT}", str(kinds.MEMORY)),  # `k` names another kind
                 (f"{record}:{OWNER}:{AGENT}:x", record), (f"{record}:{OWNER}", record),
                 (f"{record}:{OWNER}:{OTHER}", record)):          # an agent not under it
        assert _fault(kinds.DELETION, (("a", a), ("k", k))) == refusal, (a, k)


def test_json_content_is_one_object_nothing_else() -> None:
    """The rows whose content is JSON (a profile, a managed-agent record) take an object:
    readers index into it, and an array, a number, a string or null read as no record."""
    rows = [kind for kind, shape in intents.KINDS.items() if shape.json_content]
    assert rows == [kinds.METADATA, kinds.MANAGED_AGENT]
    for kind in rows:
        assert _fault(kind, FITS[kind][1], "{}") is None
        for content in ("[]", "1", '"x"', "null", "true", "", "not json", "{"):
            assert _fault(kind, FITS[kind][1], content) == (
                f"kind {kind}: content is not a JSON object"), (kind, content)
