"""Eight simulated GPU instances run side by side on one small machine."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.http_client import call
from tests.procs import running


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(x for x in status if x.startswith("VmRSS")).split()[1]) / 1024


def test_eight_sim_workers_serve_at_once(model_dir: Path, tmp_path: Path) -> None:
    # Each models a full H100's KV capacity (~427K tokens, 52 GiB of blocks), mapped lazily.
    args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(8) as pool:
            workers = list(
                pool.map(
                    lambda i: stack.enter_context(running("connector.worker", args, tmp_path)),
                    range(8),
                )
            )
        for i, worker in enumerate(workers):
            status, body = call(
                worker.url + "/generate",
                {
                    "input_ids": list(range(100 + i, 300 + i)),
                    "sampling_params": {"max_new_tokens": 4},
                },
            )
            assert status == 200 and body["meta_info"]["completion_tokens"] == 4
            info = call(worker.url + "/get_server_info")[1]
            assert info["max_total_num_tokens"] > 400_000
        total = sum(rss_mib(w.proc.pid) for w in workers)
        assert total < 8 * 400, f"8 workers use {total:.0f} MiB"
