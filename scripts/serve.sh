#!/usr/bin/env bash
# The README's main command: install, convert the tiny model once, and serve it with the
# SGLang API on 127.0.0.1:30000 (the router will stand in front of workers here once it lands).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh model
exec python3 -m connector.worker --backend hf --host 127.0.0.1 --port "${PORT:-30000}" "$@"
