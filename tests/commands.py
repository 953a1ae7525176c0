"""Command lines shown to readers (docs/, README.md, deploy/): taken out of fenced shell
blocks and scripts, and checked against the argument parsers of what they run, so copying
one never ends in 'unrecognized arguments'. tests/docs and tests/deploy both use it."""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tests.deploy.manifests import sglang_flags, sglang_source
from tests.procs import ROOT

# Fenced blocks a shell runs: ```bash, ```sh, ```shell, ```console or no language at all.
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}
LAUNCHERS = {"exec", "sudo", "time", "nohup", "env"}


def shell_blocks(markdown: str) -> str:
    """What runs in a Markdown file: its fenced shell blocks, one after another (a fence
    opens with its language and closes with a bare fence of at least its length, indented
    as in a list item or not)."""
    blocks: list[str] = []
    fence: str | None = None
    language = ""
    lines: list[str] = []
    for line in markdown.splitlines():
        stripped = line.strip()
        if fence is None:
            opening = re.match(r"(`{3,}|~{3,})\s*([\w-]*)", stripped)
            if opening:
                fence, language, lines = opening[1], opening[2].lower(), []
        elif stripped.startswith(fence) and not stripped.strip(fence[0]):
            if language in SHELL_LANGUAGES:
                blocks.append("\n".join(lines))
            fence = None
        else:
            lines.append(line)
    return "\n".join(blocks)


def logical_lines(text: str) -> list[str]:
    """Shell text as the shell reads it: backslash continuations joined, a default
    `${VAR:-value}` read as its value, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", text)
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def words(line: str) -> list[list[str]]:
    """A line's simple commands (split at `&&`, `;`, `|`, `&`, ...), each as its words, with
    leading `VAR=value` assignments and launchers (`exec`, `sudo`, ...) dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # not shell (an unbalanced quote: prose in an untagged block)
        return []
    out: list[list[str]] = [[]]
    for token in tokens:
        if token in SEPARATORS or set(token) <= set(";&|()"):
            out.append([])
        else:
            out[-1].append(token)
    commands = []
    for argv in out:
        while argv and (re.fullmatch(r"\w+=.*", argv[0]) or argv[0] in LAUNCHERS):
            argv = argv[1:]
        if argv:
            commands.append(argv)
    return commands


@dataclass(frozen=True, slots=True)
class Command:
    """A command this project's readers run: `python -m MODULE ARGS` (kind "module") or a
    script (kind "script": `bash scripts/serve.sh ARGS`, `python3 deploy/replicas-local.py`)."""

    kind: str
    target: str
    args: tuple[str, ...]
    line: str


def commands(text: str) -> Iterator[Command]:
    """The module and script commands in shell text."""
    for line in logical_lines(text):
        for argv in words(line):
            program, rest = argv[0], argv[1:]
            if re.fullmatch(r"python3?(\.\d+)?", program):
                if len(rest) >= 2 and rest[0] == "-m":
                    yield Command("module", rest[1], tuple(rest[2:]), line)
                elif rest and rest[0].endswith(".py"):
                    yield Command("script", rest[0], tuple(rest[1:]), line)
            elif program in {"bash", "sh"} and rest and rest[0].endswith(".sh"):
                yield Command("script", rest[0], tuple(rest[1:]), line)


def long_flags(args: tuple[str, ...] | list[str]) -> list[str]:
    """The `--flags` among arguments (`--flag=value` as `--flag`), up to a bare `--`."""
    out = []
    for a in args:
        if a == "--":
            break
        if a.startswith("--"):
            out.append(a.split("=", 1)[0])
    return out


def after_separator(args: tuple[str, ...]) -> list[str]:
    """The arguments after a bare `--` (a launcher passes them on), or none."""
    return list(args[args.index("--") + 1 :]) if "--" in args else []


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for s in parser._option_string_actions if s.startswith("--")}


def help_flags(help_text: str) -> set[str]:
    """The long options a `--help` page offers: those in its usage and those that start an
    option line (not the ones its descriptions merely mention)."""
    usage = help_text.split("\n\n", 1)[0]
    found = set(re.findall(r"(?<![\w-])(--[a-zA-Z0-9][\w-]*)", usage))
    for line in help_text.splitlines():
        if re.match(r"\s+-", line):
            left = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            found |= set(re.findall(r"(?<![\w-])(--[a-zA-Z0-9][\w-]*)", left))
    return found


@functools.cache
def help_text(*argv: str) -> str:
    """`argv --help` run once (from the repository root, without network), cached."""
    result = subprocess.run(
        [*argv, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, f"{' '.join(argv)} --help failed: {result.stderr[-2000:]}"
    return result.stdout


def module_help_flags(module: str) -> set[str]:
    return help_flags(help_text(sys.executable, "-m", module))


def router_flags() -> set[str]:
    from router.__main__ import build_parser

    return parser_flags(build_parser())


def worker_flags() -> set[str]:
    from connector.worker.__main__ import build_parser

    return parser_flags(build_parser())


class Skip(Exception):
    """This command cannot be checked here: the reason says why."""


def installed_sglang_flags() -> set[str]:
    srt = sglang_source()
    if srt is None:
        raise Skip("sglang is not installed: its server_args.py cannot be read")
    return sglang_flags(srt)


def external_help_flags(module: str) -> Callable[[], set[str]]:
    """A peer's launcher (sglang-router, smg): its installed parser, or a skip."""

    def flags() -> set[str]:
        import importlib.util

        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise Skip(f"{module.split('.')[0]} is not installed")
        return module_help_flags(module)

    return flags


# Modules whose parser is imported rather than asked for --help; SGLang's flags are read
# from its source (its launcher imports torch and CUDA kernels).
MODULE_FLAGS: dict[str, Callable[[], set[str]]] = {
    "router": router_flags,
    "connector.worker": worker_flags,
    "sglang.launch_server": installed_sglang_flags,
    "sglang_router.launch_router": external_help_flags("sglang_router.launch_router"),
    "smg.launch_router": external_help_flags("smg.launch_router"),
}


# Modules whose first argument is a subcommand with flags of its own (`mkdocs build`,
# `python -m benchmarks overload`).
SUBCOMMANDS = {"mkdocs", "benchmarks"}


def flags_of_module(module: str, args: tuple[str, ...] = ()) -> set[str]:
    """Every long flag `python -m module [SUBCOMMAND]` accepts (Skip when it cannot be known
    here)."""
    if module in SUBCOMMANDS and args and not args[0].startswith("-"):
        return help_flags(help_text(sys.executable, "-m", module, args[0]))
    known = MODULE_FLAGS.get(module)
    return known() if known is not None else module_help_flags(module)


def script_checks(command: Command) -> list[tuple[list[str], set[str], str]]:
    """(flags used, flags accepted, what accepts them) for a script command: each script
    says where its arguments go."""
    script = command.target.removeprefix("./")
    args = command.args
    if script == "scripts/serve.sh":  # "$@" goes to python -m router
        return [(long_flags(args), router_flags(), "python -m router (scripts/serve.sh)")]
    if script == "scripts/test.sh":  # "$@" goes to pytest
        return [(long_flags(args), module_help_flags("pytest"), "pytest (scripts/test.sh)")]
    if script == "scripts/sanitize.sh":  # "$@" goes to pytest too
        return [(long_flags(args), module_help_flags("pytest"), "pytest (scripts/sanitize.sh)")]
    if script in {"scripts/install.sh", "deploy/pd-local.sh"}:  # positional or no arguments
        return [(long_flags(args), set(), script)]
    if script == "deploy/replicas-local.py":  # its own flags, then router flags after --
        own = help_flags(help_text(sys.executable, str(ROOT / script)))
        return [
            (long_flags(args), own, script),
            (long_flags(after_separator(args)), router_flags(), f"python -m router ({script})"),
        ]
    raise AssertionError(f"no rule for the arguments of {script}: add one to tests/commands.py")


def unknown_flags(command: Command) -> list[str]:
    """What in `command` its parser does not know, each as a message (Skip when the parser
    cannot be had here)."""
    if command.kind == "module":
        known = flags_of_module(command.target, command.args)
        checks = [(long_flags(command.args), known, command.target)]
    else:
        assert (ROOT / command.target).exists(), f"{command.target} does not exist"
        checks = script_checks(command)
    return [
        f"{flag} (not a flag of {where})"
        for used, known, where in checks
        for flag in used
        if flag not in known
    ]
