"""Chat rendering by substitution: the template runs once per conversation shape, not per turn.

A long chat re-renders its whole history through the jinja sandbox on every turn (about
3.5 µs a message). Most chat templates copy each message's content verbatim between fixed
markers, so the text is `fixed[0] + content[0] + fixed[1] + ... + fixed[n]`, where the fixed
parts depend only on the messages' other fields (roles) and the flags. `SkeletonRenderer`
renders each such shape once with sentinel contents, keeps the fixed parts, and afterwards
joins them with the real contents.

Exact only for templates that treat content opaquely, so it refuses (and falls back to a full
render) unless all of these hold:
- every use of a message's `content` in the template is output directly, at most joined with
  `+` or `~` (no filter, test, comparison, call, method, assignment or condition on it);
- rendered with sentinels that any escaping, trimming or reformatting would change, each
  sentinel appears exactly once, in order;
- the first real render of each shape equals the substitution.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from jinja2 import nodes

from shared.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

# Quotes, backslash, markup, whitespace at both ends, non-ASCII: escaping, trimming or
# re-encoding of any kind alters it, so an altered copy is never mistaken for verbatim.
_SENTINEL = " \n\ue000\"'\\<&>\t{}\u00e9\ue001 \n"
_JOIN = (nodes.Add, nodes.Concat)


def opaque_content(source: str, env: Any) -> str | None:
    """None if `content` is only ever output verbatim in this template, else why not."""
    tree = env.parse(source)
    problems: list[str] = []

    def visit(node: nodes.Node, parents: tuple[nodes.Node, ...]) -> None:
        if _is_content(node):
            if not _output_through_joins(parents):
                where = type(parents[-1]).__name__ if parents else "nothing"
                problems.append(f"line {node.lineno}: content used inside {where}")
            return
        for child in node.iter_child_nodes():
            visit(child, (*parents, node))

    visit(tree, ())
    return problems[0] if problems else None


def _is_content(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"


def _output_through_joins(parents: tuple[nodes.Node, ...]) -> bool:
    """The innermost parents are string joins up to an Output node."""
    for parent in reversed(parents):
        if isinstance(parent, nodes.Output):
            return True
        if not isinstance(parent, _JOIN):
            return False
    return False


class SkeletonRenderer:
    """`render_chat` by substitution where provably equal, by the template otherwise."""

    def __init__(self, tokenizer: ChatTokenizer, max_shapes: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.max_shapes = max_shapes
        self._shapes: OrderedDict[tuple, list[str] | None] = OrderedDict()
        self.hits = self.builds = 0
        self.reason: str | None = None
        try:
            template = tokenizer.compiled_template  # raises without a chat template
            self.reason = opaque_content(tokenizer.chat_template or "", template.environment)
        except Exception as exc:  # no template, or one jinja cannot parse: full renders
            self.reason = f"template not analysable: {exc}"
        if self.reason is not None:
            log.info("chat rendering by substitution is off: %s", self.reason)

    @property
    def num_shapes(self) -> int:
        """Chat shapes cached now (at most `max_shapes`)."""
        return len(self._shapes)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Exactly `tokenizer.render_chat(messages, ...)`."""
        full = self.tokenizer.render_chat
        if self.reason is not None or tools:
            return full(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        key = _shape(messages, add_generation_prompt)
        if key is None:
            return full(messages, add_generation_prompt=add_generation_prompt)
        try:
            fixed = self._shapes[key]
        except KeyError:
            return self._build(key, messages, add_generation_prompt)
        self._shapes.move_to_end(key)
        if fixed is None:  # this shape does not substitute: always render
            return full(messages, add_generation_prompt=add_generation_prompt)
        self.hits += 1
        return join_fixed(fixed, [m["content"] for m in messages])

    def fixed(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[str] | None:
        """The fixed parts `render` would join these messages' contents with, when their
        shape is cached and substitutes (None: `render` it); counted as a hit by the caller."""
        if self.reason is not None or tools:
            return None
        key = _shape(messages, add_generation_prompt)
        if key is None:
            return None
        fixed = self._shapes.get(key)
        if fixed is not None:
            self._shapes.move_to_end(key)
        return fixed

    def _build(self, key: tuple, messages: Sequence[dict[str, Any]], gen: bool) -> str:
        """Render this shape with sentinels and for real; keep the fixed parts if they agree."""
        self.builds += 1
        full = self.tokenizer.render_chat(messages, add_generation_prompt=gen)
        fixed = self._fixed_parts(messages, gen)
        if fixed is not None and join_fixed(fixed, [m["content"] for m in messages]) != full:
            log.warning("chat substitution disagreed with the template; shape not cached")
            fixed = None
        self._shapes[key] = fixed
        if len(self._shapes) > self.max_shapes:
            self._shapes.popitem(last=False)
        return full

    def _fixed_parts(self, messages: Sequence[dict[str, Any]], gen: bool) -> list[str] | None:
        sentinels = [_SENTINEL.format(i) for i in range(len(messages))]
        stand_ins = [{**m, "content": s} for m, s in zip(messages, sentinels, strict=True)]
        try:
            text = self.tokenizer.render_chat(stand_ins, add_generation_prompt=gen)
        except ValueError:
            return None
        fixed, pos = [], 0
        for sentinel in sentinels:
            at = text.find(sentinel, pos)
            if at < 0 or text.count(sentinel) != 1:
                return None
            fixed.append(text[pos:at])
            pos = at + len(sentinel)
        fixed.append(text[pos:])
        return fixed


def _shape(messages: Sequence[dict[str, Any]], gen: bool) -> tuple | None:
    """Everything but the contents; None when a field cannot key a cache (lists, dicts)."""
    shape: list[Any] = [gen]
    append = shape.append
    for m in messages:
        if type(m.get("content")) is not str:
            return None
        if len(m) == 2:  # the usual message: a role and the content
            role = m.get("role")
            if type(role) is not str:
                return None
            append(role)
            continue
        fields = tuple(sorted((k, v) for k, v in m.items() if k != "content"))
        if not all(isinstance(v, str | int | float | bool | type(None)) for _, v in fields):
            return None
        append(fields)
    return tuple(shape)


def join_fixed(fixed: list[str], contents: Sequence[str]) -> str:
    """`fixed[0] + contents[0] + fixed[1] + ... + fixed[n]`: a chat rendered by substitution."""
    out = [fixed[0]]
    for content, after in zip(contents, fixed[1:], strict=True):
        out.append(content)
        out.append(after)
    return "".join(out)
