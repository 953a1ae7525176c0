#!/usr/bin/env bash
# The native code's tests (the radix tree, the decision) under AddressSanitizer and
# UndefinedBehaviorSanitizer: `bash scripts/sanitize.sh [PYTEST ARGS]`. Builds mempool._radix
# with -fsanitize=address,undefined (debug, -O1 -g) into a temporary directory, loads that
# build in place of the installed one and runs the extension's tests against it (by default
# tests/mempool/test_radix*.py and tests/router/test_decide_native.py). Any memory error or
# undefined behaviour aborts the run.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# nanobind's CMake files: the installed package, else a private copy (pip's build isolation
# keeps it out of the environment on a fresh machine)
if ! python3 -c 'import nanobind' 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$tmp/deps" nanobind
    export PYTHONPATH="$tmp/deps${PYTHONPATH:+:$PYTHONPATH}"
fi
cmake -S . -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMEMSERVE_SANITIZE=ON \
    -DPython_EXECUTABLE="$(command -v python3)" >"$tmp/cmake.log" || {
    cat "$tmp/cmake.log"
    exit 1
}
cmake --build "$tmp/build" >"$tmp/build.log" || {
    cat "$tmp/build.log"
    exit 1
}
module="$(ls "$tmp"/build/_radix*.so)"

# CPython is not instrumented: the ASan runtime must be loaded first, and libstdc++ with it
# (ASan's C++ exception interceptor binds to the libstdc++ present at start). Python's own
# allocations at exit are not ours to report (detect_leaks=0); UBSan stops at the first finding.
export LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:strict_init_order=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export MEMSERVE_SANITIZED_RADIX="$module"
(($#)) || set -- tests/mempool/test_radix.py tests/mempool/test_radix_incremental.py \
    tests/mempool/test_radix_native.py tests/router/test_decide_native.py
python3 - "$@" <<'EOF'
"""Load the sanitized mempool._radix ahead of the installed one, then run pytest."""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

import pytest

MODULE = os.environ["MEMSERVE_SANITIZED_RADIX"]


class SanitizedRadix(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name == "mempool._radix":
            return importlib.util.spec_from_file_location(name, MODULE)
        return None


sys.meta_path.insert(0, SanitizedRadix())
import mempool._radix  # noqa: E402

assert mempool._radix.__file__ == MODULE, mempool._radix.__file__
print(f"sanitized build: {os.path.basename(MODULE)}", flush=True)
sys.exit(pytest.main(["-p", "no:cacheprovider", *sys.argv[1:]]))
EOF
