#!/usr/bin/env bash
# A 1P1D pair and the prompt-tree router on this machine (127.0.0.1:30000).
# BACKEND=sim|hf (default hf), CACHING=basic|caching-1|caching-2|caching-3 (default caching-3).
set -euo pipefail
cd "$(dirname "$0")/.."
backend="${BACKEND:-hf}"
caching="${CACHING:-caching-3}"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
python3 -m connector.worker --backend "$backend" --port 30001 --instance-id 1 \
    --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 --pd-caching "$caching" &
pids+=($!)
python3 -m connector.worker --backend "$backend" --port 30002 --instance-id 2 \
    --disaggregation-mode decode --pd-caching "$caching" &
pids+=($!)
for port in 30001 30002; do
    until curl -sf "127.0.0.1:$port/health" >/dev/null; do sleep 0.5; done
done
python3 -m router --policy prompt-tree --port "${PORT:-30000}" --pd-disaggregation \
    --prefill http://127.0.0.1:30001 8998 --decode http://127.0.0.1:30002 --pd-caching "$caching" &
pids+=($!)
wait
