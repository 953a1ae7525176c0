"""A decode server's storage side, in its own process:
`python -m tests.connector.sglang.decode_server CONFIG_JSON TOKENS_JSON SEED`.

It builds the backend as SGLang does (factory from the extra config, then the host pool),
writes every whole page of TOKENS through HiCacheController's backup path (batch_set_v1),
waits for the writeback to its prefill peer, and prints one JSON line: the page keys, each
page's byte digest and the writeback totals.
"""

from __future__ import annotations

import json
import sys

from connector.sglang.cpu_paths import Controller
from tests.connector.sglang.helpers import PAGE, create, host_pool, indices, keys_of, page_digest


def main() -> None:
    config, tokens, seed = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    host = host_pool(seed=seed)
    backend = create(config, host)
    try:
        keys = keys_of(tokens)
        written = Controller(backend, host).backup(indices(len(keys)), keys)
        wb = backend.drain(30)
        out = {
            "keys": keys,
            "digests": [page_digest(host, i * PAGE) for i in range(len(keys))],
            "written_tokens": written,
            "writeback": wb.__dict__,
        }
        print(json.dumps(out), flush=True)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
