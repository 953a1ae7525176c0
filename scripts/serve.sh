#!/usr/bin/env bash
# The README's main command: install, convert the tiny model once, start two CPU workers
# with it and the prompt-tree router in front of them on 127.0.0.1:30000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh model
exec python3 -m router --policy prompt-tree --host 127.0.0.1 --port "${PORT:-30000}" "$@"
