"""The front page, README.md: at most 150 lines, it starts with the two commands, and every
relative link in it (written from the repository root) leads to a file that exists; its
pages are in the docs site."""

from __future__ import annotations

import re
from pathlib import Path

from tests.procs import ROOT

MAX_LINES = 150


def front_page() -> Path:
    return ROOT / "README.md"


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


def test_the_front_page_starts_with_the_two_commands() -> None:
    """The main job and the tests, in the first shell block, before any other section."""
    text = front_page().read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert text.index("```bash") < text.index("\n## ")
    assert first_block.startswith("bash scripts/serve.sh")
    assert "bash scripts/test.sh" in first_block
