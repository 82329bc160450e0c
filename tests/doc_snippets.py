"""The code blocks of the README and the docs, for the tests that run them.

A block users may copy (a fenced block in any language but ``text``) carries a marker on the line before it,
``<!-- snippet: NAME -->``. A ``python`` block is run as a script by tests/test_docs.py; any other block is
run, or checked against what runs, by the test that calls ``doc_snippet("NAME")`` (tests/test_docs.py
requires one to exist for every name). Blocks of one name in several files must be the same text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"(?:<!-- snippet: ([\w-]+) -->\n)?```(\w*)\n(.*?)\n```", re.S)


@dataclass(frozen=True)
class Snippet:
    path: str  # relative to the repository
    line: int
    name: str | None
    lang: str
    code: str


def doc_files() -> list[Path]:
    """The README and every page of the docs site."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def snippets(path: Path) -> list[Snippet]:
    text = path.read_text(encoding="utf-8")
    return [Snippet(str(path.relative_to(REPO)), text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2), m.group(3))
            for m in FENCE.finditer(text)]


def all_snippets() -> list[Snippet]:
    return [s for path in doc_files() for s in snippets(path)]


def doc_snippet(name: str) -> str:
    """The code of the block(s) named ``name``; every copy of it must read the same."""
    found = [s for s in all_snippets() if s.name == name]
    assert found, f"no block is marked <!-- snippet: {name} --> in README.md or docs/"
    assert len({s.code for s in found}) == 1, f"the blocks named {name} differ: {[(s.path, s.line) for s in found]}"
    return found[0].code
