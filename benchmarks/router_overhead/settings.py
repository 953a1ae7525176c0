"""Sizes, targets and the workloads' text: seeded English-like prose, small chats and 8K
conversations, so every system sees the same requests."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

NAME = "router_overhead"
SEED = 20240623

CONV_TOKENS = 8192  # a cold chat is at least this long (tokens, chat template included)
SMALL_MAX_TOKENS = 8  # latency workloads: a short answer
RPS_MAX_TOKENS = 1
CORE_COUNTS = (1, 2)  # the CPU sets' sizes every router runs on (taskset)

# issue 34's (the decision in native code): Dynamo's indexer decides in about 10 us
TARGET_DECISION_P50_US = 10.0
TARGET_MULTI_TURN_ADDED_P50_MS = 0.7
TARGET_COLD_ADDED_P50_MS = 1.5
TARGET_RPS_RATIO = 1.0  # ours (prompt_tree, a process per core) / sglang-router (cache_aware)

WORKLOAD_TITLES = {
    "small": "small chat (~50 tok)",
    "cold_8k": "cold 8K chat",
    "multi_turn": "multi-turn 8K (turn >= 2)",
    "shared_text": "8K text, shared prefix",
}
WORKLOADS = tuple(WORKLOAD_TITLES)


@dataclass(frozen=True)
class Settings:
    """Sizes and durations: quick mode trades precision for a run of about a minute."""

    quick: bool
    small_requests: int  # per system
    conversations: int  # 8K conversations per system
    turns: int  # per conversation: 1 cold turn, then turns - 1 multi-turn requests
    rps_duration_s: float  # max requests/s: counted, per system
    rps_slices: int  # the window is run in this many slices, interleaved across systems
    decision_calls: int  # timed select() calls per case
    tokenizer_conversations: int  # conversations timed for the tokenizer's cost
    concurrency: int = 32  # max requests/s: concurrent clients
    rps_warmup_s: float = 0.3  # per slice, not counted
    tree_conversations: int = 200  # decision time: conversations in the prompt trees
    tree_workers: int = 4


QUICK = Settings(True, 60, 6, 4, 2.0, 2, 200, 12)  # the fields in order, up to the defaults
FULL = Settings(False, 1000, 100, 5, 10.0, 5, 1000, 40)

# Common English words plus a domain's vocabulary: text that tokenizes like prose, about one
# token per word with SmolLM2's tokenizer.
_WORD_TEXT = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if so "
    "no will more can who out up about into some could them than other time only new these two "
    "may first then do any like my now over such our man me even most made after also did many "
    "before must through back years where much your way down should because long each just "
    "state people those too how little good world very still own see men work get here between "
    "both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three shipment parcel warehouse invoice "
    "customer route delivery pallet carrier freight customs schedule driver depot container "
    "manifest tracking weight volume priority express standard refund claim damaged delayed "
    "address postcode signature insurance declared value border permit hazardous fragile"
)
WORDS = _WORD_TEXT.split()
SYSTEM_PROMPT = (
    "You are a meticulous assistant for a logistics company. Always answer with the shipment "
    "policy in mind, cite the section you rely on, keep answers short, and ask for the "
    "tracking number when it is missing. Never promise a delivery date the carrier has not "
    "confirmed. Escalate damaged or hazardous goods to a human agent. "
) * 2


class TextMaker:
    """Seeded prose: sentences of common words with capitals, numbers and punctuation."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def sentence(self) -> str:
        rng = self.rng
        words = rng.choices(WORDS, k=rng.randint(6, 18))
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(2, 9999)))
        if rng.random() < 0.2:
            words[rng.randrange(len(words))] += ","
        text = " ".join(words)
        return text[0].upper() + text[1:] + rng.choice(".....?!")

    def paragraph(self, words: int) -> str:
        """About `words` words of sentences, sometimes broken into paragraphs."""
        out: list[str] = []
        count = 0
        while count < words:
            s = self.sentence()
            count += s.count(" ") + 1
            out.append(s)
            if self.rng.random() < 0.12:
                out.append("\n\n")
        return " ".join(out).replace(" \n\n ", "\n\n").strip()


@dataclass
class Conversation:
    """One 8K chat: turn 1 is the whole history ending with a user message; each later turn
    adds a scripted reply (the benchmark sends the worker's real answer instead) and a question."""

    turns: list[list[dict[str, str]]]
    tokens: int  # turn 1's prompt tokens (chat template included)


def make_conversation(
    tokenizer: Any, index: int, turns: int, target: int = CONV_TOKENS, exact: bool = True
) -> Conversation:
    """Seeded by `index`; turn 1 has at least `target` tokens (estimated when not `exact`)."""
    text = TextMaker(SEED * 1000 + index)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    tokens = len(tokenizer.encode(SYSTEM_PROMPT, False)) + 5  # ~5 template tokens a message
    while True:
        while tokens < target or messages[-1]["role"] != "user":
            role = "assistant" if messages[-1]["role"] == "user" else "user"
            content = f"[{index}.{len(messages)}] " + text.paragraph(text.rng.randint(220, 340))
            messages.append({"role": role, "content": content})
            tokens += len(tokenizer.encode(content, False)) + 5
        if not exact:
            break
        tokens = len(tokenizer.encode_chat(messages))
        if tokens >= target:
            break
    out = [list(messages)]
    for turn in range(2, turns + 1):
        reply = text.paragraph(text.rng.randint(25, 45))
        question = f"Turn {turn}: " + text.sentence() + " " + text.sentence()
        out.append(
            [
                *out[-1],
                {"role": "assistant", "content": reply},
                {"role": "user", "content": question},
            ]
        )
    return Conversation(out, tokens)


def small_prompts(n: int) -> list[list[dict[str, str]]]:
    """~50-token chats (SmolLM2's template adds its default system prompt)."""
    rng = TextMaker(SEED).rng
    return [
        [{"role": "user", "content": f"Question {i}: " + " ".join(rng.choices(WORDS, k=16)) + "?"}]
        for i in range(n)
    ]


def shared_text_prompts(conversation: Conversation) -> tuple[str, str]:
    """Two text prompts sharing a document (the first turn as plain text, like a tool prompt
    or a file in an agent's context), each with its own last question."""
    document = "\n\n".join(m["content"] for m in conversation.turns[0])
    return (
        f"{document}\n\nQuestion: what is this text about?",
        f"{document}\n\nQuestion: which words does it use most?",
    )
