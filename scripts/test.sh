#!/usr/bin/env bash
# The README's test command: installs everything from nothing, lints, type-checks, builds the
# docs, runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,model
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy  # pyproject.toml: every package and the tests; strict on mempool/ and router/
# The documentation site: a broken link, a page missing from the nav or a bad anchor fails it.
# Built into a temporary directory, never into the repository.
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict --site-dir "$site"
# pytest exits 5 when no test ran: with set -e that fails the run, as it should. Two workers
# (pytest-xdist), each test file on one of them so a file's shared servers start once: most
# of the suite waits on the servers it starts, so two streams take about 60% of one's time.
python3 -m pytest -p no:cacheprovider -n 2 --dist loadfile "$@"
