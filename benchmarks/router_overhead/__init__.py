"""What a router adds on top of its workers: ours (`python -m router`) and sglang-router.

Run: ``python -m benchmarks.router_overhead --out DIR [--quick]``. Writes
DIR/router_overhead.json, DIR/router_overhead.md and DIR/router_overhead.png.

Two sim workers with ``--time-scale 0`` (they answer in about a millisecond, so what a router
adds dominates) are started on free loopback ports, and in front of the very same workers:
our router with ``--policy prompt_tree`` and ``round_robin``, and, when the PyPI package
``sglang-router`` is importable, sglang-router with ``cache_aware`` and ``round_robin``.
Nothing is installed here: a peer that is not importable is skipped and the results say so.

Measured per system, against the baseline of sending the same requests straight to a worker:

- added latency p50/p99 (end to end through the router minus the baseline's, one client
  sending sequentially so no queueing blurs it) for small chat prompts (~50 tokens), cold
  8K-token chats (each a new conversation) and multi-turn chats (turn 2 onwards of those
  8K conversations: the history resent with the answer the worker just gave, as a chat client
  sends it, plus a new short user message);
- maximum requests/s: small chat prompts, non-streaming, max_tokens 1, from N concurrent
  clients in one process for a fixed time.

In process (no HTTP): our policy's decision time for an 8K-token request over prompt trees
holding 200 conversations of 8K tokens on 4 workers (PromptTree.select, tokenizing excluded),
and the tokenizer's own cost (ChatTokenizer.encode_chat; CachedEncoder cold and warm).

Targets are reported, never asserted: the machines these run on are shared and noisy.

Modules: `settings` (sizes, workloads, targets), `text` (the chats), `systems` (the
processes), `phases` (the HTTP measurements, through `benchmarks.load`), `in_process` (tokenizer and
decision time), `figures` and `targets` (from samples to results), `report` and `plots` (the
files), `__main__` (the run).
"""
