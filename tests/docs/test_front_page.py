"""The front page: README.md once it is the short one, docs/_front_page.md until the swap.
At most 150 lines, and every relative link in it (written from the repository root) leads to
a file that exists; its pages are in the docs site."""

from __future__ import annotations

import re
from pathlib import Path

from tests.procs import ROOT

MAX_LINES = 150


def front_page() -> Path:
    readme = ROOT / "README.md"
    if len(readme.read_text().splitlines()) <= MAX_LINES:
        return readme
    return ROOT / "docs" / "_front_page.md"


def test_the_front_page_is_short() -> None:
    lines = front_page().read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"{front_page().name}: {len(lines)} lines"


def test_every_link_of_the_front_page_leads_somewhere() -> None:
    text = front_page().read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"\w+:", link)]
    assert relative, "no link into the docs"
    for link in relative:
        path = link.split("#", 1)[0]
        assert (ROOT / path).exists(), f"{link}: no {path} in the repository"
    assert any(link.startswith("docs/") for link in relative)
