"""Generate docs/api/buzz_broker_client.md, the agent-side client's API reference.

    python scripts/client_reference.py          # rewrite the file
    python scripts/client_reference.py --check  # exit 1 if it is not what the code says

Everything in the file comes from the docstrings and signatures of `buzz_broker_client`'s
public surface (its `__all__`) and of the outcome types its answers carry
(`buzzwire.contract`), rendered by griffe2md (Markdown from Griffe, the mkdocstrings
project's static reader: nothing is imported or run to read it). Markdown rather than
pdoc's HTML, because the reference is read on GitHub beside the other docs, and GitHub
shows HTML as source.

What this file adds to griffe2md's output is links that work on GitHub: griffe2md links
an object by its dotted path (`#buzz_broker_client.client.RetryPolicy`), GitHub anchors a
heading by its slug, so each link goes to the heading of the object it names, and a link
to something this page does not document (`str`, `Callable`) becomes plain text.
tests/docs/test_client_reference.py holds the committed file to this script.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from griffe import GriffeLoader, Parser
from griffe2md import render_object_docs

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "api" / "buzz_broker_client.md"

#: The outcome types a `Succeeded.outcome` can be, documented after the package.
OUTCOMES = ("PublishOutcome", "ReadOutcome", "Event", "StorageAddressOutcome",
            "StorageGetOutcome", "ObserverEmitOutcome", "AgentsCreateOutcome",
            "AgentsUpdateOutcome", "AgentsDeleteOutcome")

CONFIG: dict[str, object] = {
    "docstring_style": "google",
    "members_order": "source",
    "show_submodules": False,
    "inherited_members": False,
    "show_signature_annotations": True,
    "filters": ["!^_"],
    "heading_level": 2,
}

HEADER = """\
# `buzz_broker_client`: API reference

Generated from the docstrings by `python scripts/client_reference.py` (griffe2md); do not
edit by hand: `tests/docs/test_client_reference.py` fails when this file is stale. The
guide is [../agents.md](../agents.md); the wire protocol, for any language, is
[../protocol.md](../protocol.md).

"""

_HEADING = re.compile(r"^#{2,6} `([\w.]+)`$", re.M)
_LINK = re.compile(r"\[([^\]]*)\]\(#([\w.]+)\)")


def _slug(path: str) -> str:
    """GitHub's anchor for a heading that is `path` in backticks."""
    return re.sub(r"[^\w\- ]", "", path.lower()).replace(" ", "-")


def _link_to_headings(text: str) -> str:
    headings = _HEADING.findall(text)

    def target(path: str) -> str | None:
        if path in headings:
            return path
        parts = path.split(".")
        for k in range(1, len(parts)):  # `buzz_broker_client.client.RetryPolicy` -> `RetryPolicy`
            tail = "." + ".".join(parts[k:])
            found = [h for h in headings if h.endswith(tail)]
            if len(found) == 1:
                return found[0]
        return None

    def link(match: re.Match[str]) -> str:
        found = target(match.group(2))
        return match.group(1) if found is None else f"[{match.group(1)}](#{_slug(found)})"

    return _LINK.sub(link, text)


def render() -> str:
    # One Returns item a method: its text names the answer types, continued over lines.
    # buzz_broker_client is under client/, buzzwire (its own distribution) at the top.
    loader = GriffeLoader(search_paths=[str(REPO / "client"), str(REPO)],
                          docstring_parser=Parser.google,
                          docstring_options={"returns_multiple_items": False},
                          allow_inspection=False)
    package = loader.load("buzz_broker_client")
    contract = loader.load("buzzwire.contract")
    loader.resolve_aliases(external=False)
    parts = [render_object_docs(package, CONFIG)]  # type: ignore[arg-type]
    parts.append("## Outcome types (`buzzwire.contract`)\n\nWhat `Succeeded.outcome` holds, "
                 "by action (re-exported by `buzzwire.contract`).\n")
    for name in OUTCOMES:
        parts.append(render_object_docs(contract[name], {**CONFIG, "heading_level": 3}))  # type: ignore[arg-type]
    text = "\n".join(part.strip() + "\n" for part in parts)
    text = _link_to_headings(text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return HEADER + text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(REPO)} is stale: run python scripts/client_reference.py")
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
