"""The router command lines deploy/'s README and scripts show operators: every one is
accepted by the router's own parser, so copying one never ends in 'unrecognized arguments'."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.deploy.manifests import DEPLOY, router_args

SOURCES = ["README.md", "pd-local.sh", "systemd/memserve-router.service"]


def shell_text(source: str) -> str:
    """What runs: a Markdown file's fenced code blocks, a shell script as it is."""
    text = (DEPLOY / source).read_text()
    if source.endswith(".md"):
        return "\n".join(re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S))
    return text


def router_commands(text: str) -> list[list[str]]:
    """`python -m router ...` (and a unit's `ROUTER_ARGS=...`) lines, backslash continuations
    joined, comments dropped, a shell default `${VAR:-value}` read as its value."""
    text = re.sub(r"\\\n\s*", " ", text)
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
    commands = []
    for line in text.splitlines():
        match = re.search(r"(?:ROUTER_ARGS=|python3? -m router )(.*)", line)
        if match and match[1] != "$ROUTER_ARGS":  # the unit's ExecStart: its flags are above
            commands.append(shlex.split(match[1].split(" # ")[0].rstrip(" &")))
    return commands


@pytest.mark.parametrize("source", SOURCES)
def test_every_router_command_shown_is_accepted(source: str) -> None:
    commands = router_commands(shell_text(source))
    assert commands, f"no router command in {source}"
    for argv in commands:
        router_args(argv)
