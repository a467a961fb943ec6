"""Each Nostr kind is written once, in buzzwire/kinds.py: no module of ours binds a kind
name to a number of its own (a constant written twice drifts), and each action publishes
the kind NIP-BA names (tests/conformance/_spec.py's transcription)."""

from __future__ import annotations

import ast
from pathlib import Path

from buzzwire import kinds
from buzzwire.contract import ACTIONS
from tests.conformance._spec import NIP_BA_KINDS

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (REPO / "daemon", REPO / "custody", REPO / "buzzwire",
            REPO / "client" / "buzz_broker_client")
TABLE = REPO / "buzzwire" / "kinds.py"


def _numbers(node: ast.expr | None) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_numbers(e) for e in node.elts)
    return False


def test_no_module_binds_a_kind_to_a_number_of_its_own() -> None:
    found = []
    for root in PACKAGES:
        for path in sorted(root.rglob("*.py")):
            if path == TABLE:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif isinstance(node, ast.AnnAssign):
                    targets, value = [node.target], node.value
                else:
                    continue
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if any("KIND" in n.upper() for n in names) and _numbers(value):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {names}")
    assert not found, found


def test_every_published_kind_is_in_the_table() -> None:
    table = {v for k, v in vars(kinds).items() if k.isupper()}
    assert len(table) == len([k for k in vars(kinds) if k.isupper()]), "a number named twice"
    assert {spec.published_kind for spec in ACTIONS.values()} - {None} <= table


def test_each_action_publishes_the_kind_nip_ba_names() -> None:
    # The client checks a Published outcome's kind per action, so a wrong entry (24200 for
    # liveness.ping, NIP-AO telemetry, which this host does not offer) refuses a right answer.
    published = {name: spec.published_kind for name, spec in ACTIONS.items()
                 if spec.published_kind is not None}
    assert published == NIP_BA_KINDS
