"""Table-driven strict objects: one `Shape` per argument/outcome/event type.

Rules:
- A shape is a tuple of `Field`s (wire name, attribute, checker, required, absent value) plus
  an optional cross-member rule. The same table drives three things: reading a wire object
  (`read_object`), re-checking a constructed dataclass (`check_instance`, called from
  `__post_init__`, inherited from `Checked`, so an invalid value cannot exist) and writing the canonical wire object
  (`to_wire`, absent members omitted: never null, never `[]`, never `false` for a default).
- The reader builds its instance without calling `__init__` (it has already run every
  check); therefore a dataclass's defaults MUST equal its fields' `absent` values, and no
  shape class may do anything in `__post_init__` beyond `check_instance`.
- Reading order, which fixes "the first fault" inside one object: unknown members in
  document order, then members in table order (missing required, bad value), then the
  cross-member rule (reported at the object's pointer).
- Two error families: reading raises `ContractError` (Remote, carries a pointer);
  constructing with a non-canonical or invalid value raises `ValueError` (Local, our bug).

WARNING: the member sets in `ACTIONS` are derived from these tables; tests pin them with
their own literal table, so adding a field means touching both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from ._codes import ContractError
from ._ids import Checker, fault
from ._json import escape_token, is_object
from ._rules import Rule
from ._text import trim

__all__ = ["Field", "Shape", "SHAPES", "Checked", "register", "shape_for", "read_object",
           "check_instance", "to_wire", "array_of", "nested", "one_of"]

_T = TypeVar("_T")
# Covariant: a shape only hands out instances of its class, so a Shape[MessagePostArgs]
# can stand wherever a Shape[Args] (or the registry's Shape[object]) is expected.
_T_co = TypeVar("_T_co", covariant=True)

#: A rule across one object's members: the `Rule` it breaks, or None.
CrossRule = Callable[[Mapping[str, object]], "Rule | None"]


@dataclass(frozen=True, slots=True)
class Field:
    wire: str
    attr: str
    check: Checker
    required: bool = False
    #: the attribute value that means "absent" (None; () for arrays; False for mentionsOnly)
    absent: object = None

    @property
    def suffix(self) -> str:
        return "/" + escape_token(self.wire)

    def is_absent(self, value: object) -> bool:
        if self.absent is None:
            return value is None
        return type(value) is type(self.absent) and value == self.absent


@dataclass(frozen=True, slots=True)
class Shape(Generic[_T_co]):
    cls: type[_T_co]
    fields: tuple[Field, ...]
    rule: CrossRule | None = None

    @property
    def wire_names(self) -> frozenset[str]:
        return frozenset(f.wire for f in self.fields)


SHAPES: dict[type, Shape[object]] = {}


def register(shape: Shape[_T]) -> Shape[_T]:
    SHAPES[shape.cls] = shape
    return shape


def shape_for(cls: type[_T]) -> Shape[_T]:
    """The registered shape of `cls`, typed as a shape of `cls`.

    Raises:
        KeyError: `cls` has no registered shape (our bug).
    """
    # `register` files every shape under its own `cls`, so the entry for `cls` is a
    # Shape[cls]; a dict cannot say that per key, hence the cast.
    return cast(Shape[_T], SHAPES[cls])


def read_object(value: object, pointer: str, shape: Shape[_T]) -> _T:
    """Read one strict wire object into `shape.cls`.

    Raises:
        ContractError: invalid_request with the pointer of the first fault.
    """
    if not is_object(value):
        raise fault(pointer, Rule.EXPECTED_OBJECT)
    obj: dict[str, object] = value
    names = shape.wire_names
    for key in obj:
        if key not in names:
            raise fault(f"{pointer}/{escape_token(key)}", Rule.UNKNOWN_MEMBER)
    kwargs: dict[str, object] = {}
    for f in shape.fields:
        if f.wire in obj:
            kwargs[f.attr] = f.check(obj[f.wire], pointer + f.suffix)
        elif f.required:
            raise fault(pointer + f.suffix, Rule.MISSING_MEMBER)
    if shape.rule is not None:
        broken = shape.rule(kwargs)
        if broken is not None:
            raise fault(pointer, broken)
    # Every member has just passed its checker and the rule, so the values are canonical:
    # build without re-running them (measured: the re-check cost a quarter of a request).
    # Public construction still runs `check_instance`; this path is private to the reader.
    instance = object.__new__(shape.cls)
    for f in shape.fields:
        object.__setattr__(instance, f.attr, kwargs.get(f.attr, f.absent))
    return instance


def check_instance(instance: object) -> None:
    """`__post_init__` body: every value canonical and valid, every rule kept.

    Raises:
        ValueError: the instance could not have come from a valid wire object (our bug).
    """
    shape = SHAPES[type(instance)]
    name = type(instance).__name__
    present: dict[str, object] = {}
    for f in shape.fields:
        value = getattr(instance, f.attr)
        if not f.required and f.is_absent(value):
            continue
        try:
            canonical = f.check(value, f.attr)
        except ContractError as exc:
            raise ValueError(f"{name}.{f.attr}: {exc.detail}") from None
        if canonical != value or type(canonical) is not type(value):
            raise ValueError(f"{name}.{f.attr}: not in canonical form")
        present[f.attr] = value
    if shape.rule is not None:
        broken = shape.rule(present)
        if broken is not None:
            raise ValueError(f"{name}: {broken.reason()}")


class Checked:
    """Base of every shape class: its `__post_init__` is `check_instance`, and nothing more.

    One definition instead of one per class, so no shape class can drift into doing more
    in `__post_init__` than the reader (which skips `__init__`) would do. Slot-less, so the
    subclasses stay slotted dataclasses.
    """

    __slots__ = ()

    def __post_init__(self) -> None:
        check_instance(self)


def _wire_value(value: object) -> object:
    if type(value) is tuple:
        return [_wire_value(item) for item in value]
    if type(value) in SHAPES:
        return to_wire(value)
    return value


def to_wire(instance: object) -> dict[str, object]:
    """The canonical wire object: members in table order, absent members omitted."""
    shape = SHAPES[type(instance)]
    out: dict[str, object] = {}
    for f in shape.fields:
        value = getattr(instance, f.attr)
        if not f.required and f.is_absent(value):
            continue
        out[f.wire] = _wire_value(value)
    return out


def array_of(
    item: Checker, *, max_items: int | None = None, allow_empty: bool, dedupe: bool = False
) -> Checker:
    """A checker for an array (a tuple once frozen).

    `allow_empty=False` is I6 for optional arrays: absence is spelled by omission, so `[]`
    is malformed. `dedupe` keeps the first occurrence of each canonical item; `max_items`
    counts the array as sent.
    """

    def check(value: object, pointer: str) -> tuple[object, ...]:
        if type(value) is not list and type(value) is not tuple:
            raise fault(pointer, Rule.EXPECTED_ARRAY)
        items = value
        if not items and not allow_empty:
            raise fault(pointer, Rule.EMPTY_ARRAY)
        if max_items is not None and len(items) > max_items:
            raise fault(pointer, Rule.ITEMS, max=max_items)
        if type(item) is _Nested and item.all_built(items):
            # Each entry is already an instance of the nested shape, which that checker
            # returns as is: the same tuple, without a call and a pointer per entry (a
            # page of 100 events re-checked on every channel.read answer).
            out = tuple(items)
        else:
            out = tuple(item(entry, f"{pointer}/{index}") for index, entry in enumerate(items))
        if dedupe and len(set(out)) != len(out):
            out = tuple(dict.fromkeys(out))
        return out

    return check


class _Nested:
    """The checker `nested` returns: a nested strict object; an already-built instance
    passes as is (`array_of` asks `all_built` to pass a whole array of them at once)."""

    __slots__ = ("_shape_of",)

    def __init__(self, shape_of: Callable[[], Shape[object]]) -> None:
        self._shape_of = shape_of

    def __call__(self, value: object, pointer: str) -> object:
        shape = self._shape_of()
        if type(value) is shape.cls:
            return value
        return read_object(value, pointer, shape)

    def all_built(self, items: list[object] | tuple[object, ...]) -> bool:
        """Every item is exactly an instance of the shape's class (what `__call__` passes)."""
        return set(map(type, items)) <= {self._shape_of().cls}


def nested(shape_of: Callable[[], Shape[object]]) -> Checker:
    """A checker for a nested strict object; an already-built instance passes as is."""
    return _Nested(shape_of)


def one_of(*choices: str) -> Checker:
    """A string, trimmed of White_Space, that must be one of `choices`."""
    allowed = frozenset(choices)

    def check(value: object, pointer: str) -> str:
        if type(value) is not str:
            raise fault(pointer, Rule.EXPECTED_STRING)
        string = trim(value)
        if string not in allowed:
            raise fault(pointer, Rule.ONE_OF, choices=", ".join(sorted(allowed)))
        return string

    return check
