#!/usr/bin/env bash
# The README's test command: installs everything from nothing, lints, type-checks, runs the
# whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,model
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy  # pyproject.toml: every package and the tests; strict on mempool/ and router/
# pytest exits 5 when no test ran: with set -e that fails the run, as it should.
python3 -m pytest -p no:cacheprovider "$@"
