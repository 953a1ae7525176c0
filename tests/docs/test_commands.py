"""Every command the docs, the README and deploy/'s pages show works as written: each
`python -m MODULE`, `python3 deploy/*.py` and `bash scripts/*.sh` line in their fenced shell
blocks names only flags that its parser knows (SGLang's launcher: the installed SGLang's; a
peer router's: its installed parser; skipped, with the reason, where that parser is not
installed)."""

from __future__ import annotations

import pytest

from tests.commands import Command, Skip, commands, shell_blocks, unknown_flags
from tests.procs import ROOT

DOCS = sorted((ROOT / "docs").rglob("*.md"))
# deploy/'s own pages too: tests/deploy checks their router lines further (PD pairs, replicas)
SOURCES = [ROOT / "README.md", *DOCS, *sorted((ROOT / "deploy").glob("*.md"))]


def shown(path_name: str) -> list[Command]:
    return list(commands(shell_blocks((ROOT / path_name).read_text())))


def all_shown() -> list[tuple[str, Command]]:
    return [(str(p.relative_to(ROOT)), c) for p in SOURCES for c in shown(str(p.relative_to(ROOT)))]


@pytest.mark.parametrize("source", [str(p.relative_to(ROOT)) for p in SOURCES])
def test_every_flag_shown_is_known(source: str) -> None:
    problems = []
    skipped = []
    for command in shown(source):
        try:
            unknown = unknown_flags(command)
        except Skip as why:
            skipped.append(f"{command.target}: {why}")
            continue
        problems += [f"{command.line}\n    {u}" for u in unknown]
    assert not problems, f"{source}:\n" + "\n".join(problems)
    if skipped and len(skipped) == len(shown(source)):
        pytest.skip("; ".join(sorted(set(skipped))))


def test_the_docs_show_the_commands_they_are_about() -> None:
    """The extraction finds what the pages promise (a test that reads nothing passes)."""
    targets = {c.target for _, c in all_shown()}
    for expected in (
        "router",
        "connector.worker",
        "mempool",
        "sglang.launch_server",
        "benchmarks",
        "scripts/serve.sh",
        "scripts/test.sh",
        "deploy/pd-local.sh",
        "deploy/replicas-local.py",
    ):
        assert expected in targets, f"no {expected} command found in the docs"
    suites = {c.args[0] for _, c in all_shown() if c.target == "benchmarks" and c.args}
    assert {"multiturn", "capacity", "reliability", "soak", "router-overhead"} <= suites


def test_an_unknown_flag_is_caught() -> None:
    """The check itself: a misspelt flag in each kind of command is reported."""
    text = """```bash
python -m router --policy prompt-tree --worker-url http://127.0.0.1:30001 \\
    --page-size 16
PORT=31000 bash scripts/serve.sh --polcy cost
python3 deploy/replicas-local.py --routers 2 -- --kv-events-subscrbe
python -m connector.worker --backend sim --kv-event-config '{}' && curl -s x
python -m benchmarks.soak --minutes 1 --rps 4 --pds
python -m benchmarks overload --quick --seedz 2
```
"""
    found = {c.target: unknown_flags(c) for c in commands(shell_blocks(text))}
    assert found["router"] == ["--worker-url (not a flag of router)"]
    assert found["scripts/serve.sh"] == [
        "--polcy (not a flag of python -m router (scripts/serve.sh))"
    ]
    assert found["deploy/replicas-local.py"] == [
        "--kv-events-subscrbe (not a flag of python -m router (deploy/replicas-local.py))"
    ]
    assert found["connector.worker"] == ["--kv-event-config (not a flag of connector.worker)"]
    assert found["benchmarks.soak"] == ["--pds (not a flag of benchmarks.soak)"]
    assert found["benchmarks"] == ["--seedz (not a flag of benchmarks)"]
