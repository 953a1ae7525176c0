# ruff: noqa: RUF001
# (RUF001: fullwidth punctuation in the Chinese and Japanese texts is what they are made of.)
"""The long documents sent as text prompts, the same text for the same tokenizer on every run:
generated from a seed or read from this repository (no data file ships; README.md in this
folder says how each is made, and their sizes)."""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from benchmarks.harness import REPO_ROOT

SEED = 37  # issue 37; a document's generator is seeded with f"{SEED}:{key}"


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


# Frequent modern Chinese words (function words, pronouns, verbs, nouns of everyday prose).
_ZH_WORDS = (
    "我们 他们 你们 这个 那个 一个 没有 什么 时候 自己 知道 可以 已经 因为 所以 但是 如果 "
    "就是 还是 或者 现在 今天 明天 昨天 觉得 发现 开始 继续 问题 事情 地方 工作 生活 城市 "
    "国家 社会 经济 文化 历史 时间 世界 朋友 家人 孩子 老师 学生 学校 医院 公司 市场 技术 "
    "发展 研究 计划 系统 数据 方法 结果 影响 关系 情况 过程 条件 能力 机会 希望 需要 应该 "
    "认为 表示 提出 进行 完成 提高 建立 保持 改变 解决 参加 组织 管理 服务 交通 环境 天气 "
    "春天 夏天 秋天 冬天 早上 晚上 河流 山上 街道 房子 窗户 桌子 书本 故事 声音 颜色 "
    "非常 特别 一直 慢慢 终于 突然 常常 也许 一定 真的 大家 每天 这里 那里 远方 附近 "
    "美丽 安静 热闹 重要 简单 复杂 清楚 新的 旧的 很多 一些 所有 其中 之后 之前 以后 "
    "的 了 在 是 和 也 都 就 把 被 对 从 向 给 让 说 看 走 想 做 用 有 到 去 来 会 能 要"
)
ZH_WORDS = _ZH_WORDS.split()
_ZH_END = "。。。。。。？！"


def chinese_paragraphs(rng: random.Random) -> Iterator[str]:
    """Paragraphs of 3-7 sentences, each of frequent words with commas, no spaces."""
    while True:
        sentences = []
        for _ in range(rng.randint(3, 7)):
            words = rng.choices(ZH_WORDS, k=rng.randint(8, 22))
            for _ in range(rng.randint(0, 2)):
                i = rng.randrange(2, len(words) - 1)
                words[i] += rng.choice("，，，、；")
            sentence = "".join(words)
            if rng.random() < 0.1:
                sentence = "“" + sentence + "”"
            sentences.append(sentence + rng.choice(_ZH_END))
        yield "　　" + "".join(sentences)


_JA_NOUNS = (
    "私 彼 彼女 友達 先生 学生 家族 子供 会社 学校 駅 電車 仕事 会議 資料 問題 結果 天気 "
    "雨 桜 山 川 海 町 東京 京都 大阪 日本 世界 時間 今日 明日 昨日 朝 夜 季節 音楽 映画 "
    "本 手紙 写真 料理 お茶 ご飯 部屋 窓 道 公園 図書館 病院 店 市場 研究 計画 技術 情報 "
    "システム データ サーバー メール コンピューター プロジェクト チーム ニュース テスト "
    "気持ち 言葉 考え 意見 経験 理由 方法 場所 歴史 文化 社会 経済 未来 記憶 夢 心"
)
_JA_ADJ = (
    "新しい 古い 大きな 小さな 静かな 賑やかな 美しい 難しい 簡単な 大切な 長い 短い 明るい 暗い"
)
_JA_VERB_ENDS = (
    "行きました 来ました 見ました 読みました 書きました 話しました 考えました 始まりました "
    "終わりました 使います 作ります 待っています 思います 分かりました 届きました 変わりました "
    "続いています 決めました 調べました 集まりました 説明しました 確認しました です でした "
    "でしょう と言われています ことにしました ようになりました"
)
JA_NOUNS = _JA_NOUNS.split()
JA_ADJ = _JA_ADJ.split()
JA_VERB_ENDS = _JA_VERB_ENDS.split()
_JA_PARTICLES = ("は", "が", "を", "に", "で", "と", "の", "も", "へ", "から", "まで")
_JA_LINKS = ("そして、", "しかし、", "それから、", "だから、", "ところで、", "実は、", "")


def japanese_sentence(rng: random.Random) -> str:
    parts = [rng.choice(_JA_LINKS) if rng.random() < 0.3 else ""]
    for k in range(rng.randint(2, 5)):
        if rng.random() < 0.25:
            parts.append(rng.choice(JA_ADJ))
        parts.append(rng.choice(JA_NOUNS) + rng.choice(_JA_PARTICLES))
        if k and rng.random() < 0.2:
            parts.append("、")
    parts.append(rng.choice(JA_VERB_ENDS))
    text = "".join(parts)
    if rng.random() < 0.08:
        text = "「" + text + "」"
    return text + rng.choice("。。。。。？！")


def japanese_paragraphs(rng: random.Random) -> Iterator[str]:
    while True:
        yield "　" + "".join(japanese_sentence(rng) for _ in range(rng.randint(3, 8)))


def number_lines(rng: random.Random) -> Iterator[str]:
    """Lines of 12-24 integers of 1-6 digits, separated by single spaces."""
    while True:
        count = rng.randint(12, 24)
        yield " ".join(str(rng.randint(0, 10 ** rng.randint(1, 6) - 1)) for _ in range(count))


def synthetic_word_lines(rng: random.Random) -> Iterator[str]:
    """Lines of made-up words `w` + 1-4 digits (`w123 w4567 ...`)."""
    while True:
        yield " ".join(f"w{rng.randint(0, 9999)}" for _ in range(rng.randint(16, 32)))


_TOOL_VERBS = "get list create update delete search fetch send schedule cancel export import"
_TOOL_NOUNS = (
    "invoice shipment customer order ticket report calendar_event file folder user team "
    "repository branch build deployment alert metric dashboard payment refund contract "
    "warehouse parcel route driver vehicle forecast"
)
_TOOL_TEXT = (
    "the a an of for to in by with from when if only all each new current given matching "
    "returns creates updates removes optional required list identifier name status date "
    "time range filter limit page sort order value amount currency customer account user "
    "record field text query result results error default maximum minimum number string"
)
_TOOL_WORDS = _TOOL_TEXT.split()
_PARAM_TYPES = ("string", "integer", "number", "boolean", "array")


def _phrase(rng: random.Random, low: int, high: int) -> str:
    text = " ".join(rng.choices(_TOOL_WORDS, k=rng.randint(low, high)))
    return text[0].upper() + text[1:] + "."


def _tool(rng: random.Random, index: int) -> dict[str, object]:
    verb = rng.choice(_TOOL_VERBS.split())
    noun = rng.choice(_TOOL_NOUNS.split())
    properties: dict[str, object] = {}
    for _ in range(rng.randint(2, 6)):
        name = rng.choice(_TOOL_WORDS) + "_" + rng.choice(("id", "name", "at", "by", "count"))
        kind = rng.choice(_PARAM_TYPES)
        prop: dict[str, object] = {"type": kind, "description": _phrase(rng, 4, 12)}
        if kind == "string" and rng.random() < 0.3:
            prop["enum"] = sorted(set(rng.choices(_TOOL_WORDS, k=rng.randint(2, 5))))
        if kind == "array":
            prop["items"] = {"type": rng.choice(("string", "integer"))}
        properties[name] = prop
    required = sorted(rng.sample(sorted(properties), k=rng.randint(1, len(properties))))
    return {
        "type": "function",
        "function": {
            "name": f"{verb}_{noun}_{index}",
            "description": _phrase(rng, 8, 24),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def tool_list_lines(rng: random.Random) -> Iterator[str]:
    """An OpenAI-style tool list, one tool (pretty-printed JSON) at a time: the pieces join
    with ",\\n" inside one JSON array (`join_tools`)."""
    index = 0
    while True:
        index += 1
        yield json.dumps(_tool(rng, index), indent=2)


def join_tools(pieces: Sequence[str]) -> str:
    return "[\n" + ",\n".join(pieces) + "\n]"


_EMOJI_TEXT = "🚀 ✅ ❌ 🎉 🔥 ⚠️ 📦 🌧️ ☀️ 👍 👀 💡 🧪 📈 📉 🕒 🇯🇵 🇨🇳 😀 🙏"
_KEYS_TEXT = "status user_id region temp retry latency_ms 状态 城市 名前 場所 level tag count ok"
_VALUES_TEXT = "正常 异常 東京 上海 大阪 北京 ok fail true false 晴れ 雨 高 低 null"
_EMOJI = _EMOJI_TEXT.split()
_MIXED_KEYS = _KEYS_TEXT.split()
_MIXED_VALUES = _VALUES_TEXT.split()


def mixed_lines(rng: random.Random) -> Iterator[str]:
    """Log-like lines mixing emoji, Chinese and Japanese words and `key=value` pairs."""
    while True:
        parts: list[str] = []
        for _ in range(rng.randint(6, 14)):
            r = rng.random()
            if r < 0.2:
                parts.append(rng.choice(_EMOJI))
            elif r < 0.5:
                key = rng.choice(_MIXED_KEYS)
                value = rng.choice(_MIXED_VALUES) if rng.random() < 0.5 else rng.randint(0, 9999)
                parts.append(f"{key}={value}")
            elif r < 0.75:
                parts.append("".join(rng.choices(ZH_WORDS, k=rng.randint(2, 6))))
            else:
                parts.append(japanese_sentence(rng))
        yield " ".join(parts)


ENGLISH_SOURCES = (
    "docs/architecture.md",
    "docs/router/prompt-trees.md",
    "docs/router/policies.md",
    "docs/router/index.md",
)
# the Python radix tree now lives in the tests as the native one's reference model
CODE_SOURCES = ("mempool/pool.py", "tests/mempool/radix_model.py")


def file_paragraphs(paths: Sequence[str], root: Path) -> Iterator[str]:
    """The files' blank-line-separated paragraphs, in order (once through)."""
    for path in paths:
        text = (root / path).read_text()
        yield from (p for p in text.split("\n\n") if p.strip())


def file_lines(paths: Sequence[str], root: Path) -> Iterator[str]:
    for path in paths:
        yield from (root / path).read_text().splitlines()


@dataclass(frozen=True)
class Document:
    """One row of the table: a text of about `tokens` tokens and three questions after it."""

    key: str
    title: str
    source: str  # how the text is made, for the results page
    pieces: Callable[[random.Random, Path], Iterator[str]]
    separator: str = "\n\n"
    language: str = "en"  # the questions' language
    join: Callable[[Sequence[str]], str] | None = None

    def make(self, encoder: Encoder, tokens: int, root: Path = REPO_ROOT) -> str:
        """The shortest run of whole pieces from the start that is at least `tokens` tokens
        long; the same text for the same tokenizer on every run."""
        rng = random.Random(f"{SEED}:{self.key}")
        chosen: list[str] = []
        estimate = 0  # the pieces' own counts: near the whole's, not equal (joins merge)
        for piece in self.pieces(rng, root):
            chosen.append(piece)
            estimate += len(encoder.encode(piece, False))
            if estimate >= tokens * 1.5:
                break

        def count(k: int) -> int:
            return len(encoder.encode(self.text(chosen[:k]), False))

        if count(len(chosen)) < tokens:
            raise ValueError(f"{self.key}: not {tokens} tokens of source text")
        # the smallest k with count(k) >= tokens (count(len(chosen)) is)
        fewest = bisect.bisect_left(range(1, len(chosen)), tokens, key=count) + 1
        return self.text(chosen[:fewest])

    def text(self, pieces: Sequence[str]) -> str:
        return self.join(pieces) if self.join is not None else self.separator.join(pieces)


QUESTIONS = {
    "en": (
        "Question: what is this text about? Answer in one sentence.",
        "Question: which three words does it use most often?",
        "Question: summarise the last paragraph in five words.",
    ),
    "zh": (
        "问题：这段文字主要讲了什么？请用一句话回答。",
        "问题：文中最常出现的三个词是什么？",
        "问题：请用五个字概括最后一段。",
    ),
    "ja": (
        "質問：この文章は何について書かれていますか？一文で答えてください。",
        "質問：最もよく使われている言葉を三つ挙げてください。",
        "質問：最後の段落を五語で要約してください。",
    ),
}


def prompt(document: str, language: str, request: int) -> str:
    """The document, then the `request`-th question (0, 1, 2): the same long start, a new
    ending each time."""
    return f"{document}\n\n{QUESTIONS[language][request]}\n"


DOCUMENTS: dict[str, Document] = {
    d.key: d
    for d in (
        Document(
            "chinese",
            "Chinese prose",
            "generated: sentences of frequent Chinese words with Chinese punctuation (seeded)",
            lambda rng, root: chinese_paragraphs(rng),
            language="zh",
        ),
        Document(
            "japanese",
            "Japanese prose",
            "generated: sentences of Japanese nouns, particles, adjectives and verb endings "
            "(seeded)",
            lambda rng, root: japanese_paragraphs(rng),
            language="ja",
        ),
        Document(
            "numbers",
            "numbers separated by spaces",
            "generated: lines of 1-6 digit integers separated by spaces (seeded)",
            lambda rng, root: number_lines(rng),
            separator="\n",
        ),
        Document(
            "synthetic_words",
            "synthetic words (`w123 w4567 ...`)",
            "generated: `w` followed by 1-4 digits, separated by spaces (seeded)",
            lambda rng, root: synthetic_word_lines(rng),
            separator="\n",
        ),
        Document(
            "json_tools",
            "a JSON tool list",
            "generated: an OpenAI-style list of function tools, pretty-printed JSON (seeded)",
            lambda rng, root: tool_list_lines(rng),
            join=join_tools,
        ),
        Document(
            "python_code",
            "Python code",
            "this repository's " + " and ".join(CODE_SOURCES) + ", from the top",
            lambda rng, root: file_lines(CODE_SOURCES, root),
            separator="\n",
        ),
        Document(
            "english_prose",
            "English prose",
            "this repository's " + ", ".join(ENGLISH_SOURCES) + ", from the top",
            lambda rng, root: file_paragraphs(ENGLISH_SOURCES, root),
        ),
        Document(
            "mixed",
            "mixed emoji, CJK and `key=value` text",
            "generated: lines mixing emoji, Chinese and Japanese words and key=value pairs "
            "(seeded)",
            lambda rng, root: mixed_lines(rng),
            separator="\n",
        ),
    )
}
