"""The router command lines deploy/'s README and scripts show operators: every one is
accepted by the router's own parser, so copying one never ends in 'unrecognized arguments'.
(tests/docs checks every command of the docs' pages, this README's included, for flags; this
adds what the router checks before it starts: PD pairs, replica settings.)"""

from __future__ import annotations

import re
import shlex

import pytest

from tests.commands import commands, shell_blocks
from tests.deploy.manifests import DEPLOY, router_args

SOURCES = ["README.md", "pd-local.sh", "systemd/memserve-router.service"]


def shell_text(source: str) -> str:
    """What runs: a Markdown file's fenced shell blocks, a shell script as it is."""
    text = (DEPLOY / source).read_text()
    return shell_blocks(text) if source.endswith(".md") else text


def router_commands(text: str) -> list[list[str]]:
    """`python -m router ...` commands, and a unit's `ROUTER_ARGS=...` (what its ExecStart's
    `$ROUTER_ARGS` expands to; the example is in a comment)."""
    found = [list(c.args) for c in commands(text) if c.kind == "module" and c.target == "router"]
    found += [shlex.split(args) for args in re.findall(r"ROUTER_ARGS=(.*)", text)]
    return found


@pytest.mark.parametrize("source", SOURCES)
def test_every_router_command_shown_is_accepted(source: str) -> None:
    commands_shown = router_commands(shell_text(source))
    assert commands_shown, f"no router command in {source}"
    for argv in commands_shown:
        router_args(argv)
