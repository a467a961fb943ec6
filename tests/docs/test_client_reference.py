"""The client's API reference is current, and every public method documents itself
(issue 25 item 4).

- docs/api/buzz_broker_client.md is exactly what scripts/client_reference.py renders from
  the docstrings now (griffe2md, pinned in pyproject's test extra).
- Every public method of `AsyncBrokerClient` and `BrokerClient` has a Google-style
  docstring whose `Args:` names each of its parameters (no more, no fewer) and which has
  a `Returns:` section; the operation methods also say what they raise. Parsed with
  Griffe's parser, the one the reference is rendered with.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
from griffe import Docstring, DocstringSectionKind, Parser

from buzz_broker_client import AsyncBrokerClient, BrokerClient
from tests.docs.snippets import REPO

REFERENCE = REPO / "docs" / "api" / "buzz_broker_client.md"
AGENTS_MD = REPO / "docs" / "agents.md"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("client_reference",
                                                  REPO / "scripts" / "client_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_is_generated_from_the_docstrings() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == _script().render(), (
        "docs/api/buzz_broker_client.md is stale: run python scripts/client_reference.py")


def _public_methods() -> list[tuple[str, object]]:
    found = []
    for cls in (AsyncBrokerClient, BrokerClient):
        for name, member in vars(cls).items():
            if not name.startswith("_") and callable(member):
                found.append((f"{cls.__name__}.{name}", member))
    return found


@pytest.mark.parametrize(("name", "method"), _public_methods(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_method_names_its_arguments_and_result(name: str, method: object) -> None:
    doc = inspect.getdoc(method)
    assert doc, f"{name} has no docstring"
    sections = Docstring(doc).parse(Parser.google, returns_multiple_items=False)
    kinds = {s.kind for s in sections}
    params = [p for p in inspect.signature(method).parameters if p != "self"]  # type: ignore[arg-type]
    documented = [p.name for s in sections if s.kind is DocstringSectionKind.parameters
                  for p in s.value]
    assert documented == params, f"{name}: Args: names {documented}, the signature {params}"
    assert DocstringSectionKind.returns in kinds, f"{name} has no Returns: section"
    if inspect.iscoroutinefunction(method) or name.split(".")[1] in _OPERATIONS:
        assert DocstringSectionKind.raises in kinds, f"{name} has no Raises: section"


#: The methods that talk to the broker (everything but freeze and close).
_OPERATIONS = {n.split(".")[1] for n, _ in _public_methods()} - {"freeze", "close"}


def test_agents_md_lists_every_method_and_links_the_reference() -> None:
    text = AGENTS_MD.read_text(encoding="utf-8")
    assert "(api/buzz_broker_client.md)" in text
    missing = [n for n, _ in _public_methods() if n.startswith("AsyncBrokerClient.")
               and f"`{n.split('.')[1]}" not in text]
    assert missing == []
