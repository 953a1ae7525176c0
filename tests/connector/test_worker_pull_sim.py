"""Colocated sim workers pull a longer prefix from a peer before prefill (--enable-mempool-pull).

Real worker processes on loopback: a holder caches a prompt, a puller gets the prompt plus a
new tail with the router's hint (`memserve.prefix_holders`) naming the holder's MemPool
agent, pulls the pages it lacks (stand-in pages, stamped with their page hashes and checked
before use; the real pages' wire time modelled and slept) and computes only the rest. Faults
(a holder killed, frozen, with another secret, unknown) cost a recompute within a bounded
time, never the request; the holder's locks are released and no block leaks on either side.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RedisServer
from tests.connector.test_worker_sim_pd import info, kill, prompt_ids, used_pages, wait_for
from tests.http_client import call
from tests.procs import ROOT, Server, free_port, running

PAGE = 16
SECRET = "pull-test-secret"
TIMEOUT = 1.5  # the puller's --mempool-pull-timeout-secs in these tests


def sim_args(model_dir: Path, *extra: str, time_scale: str = "0") -> list[str]:
    return [
        "--backend",
        "sim",
        "--model-path",
        str(model_dir),
        "--time-scale",
        time_scale,
        "--enable-mempool-pull",
        "--mempool-secret",
        SECRET,
        "--mempool-pull-timeout-secs",
        str(TIMEOUT),
        *extra,
    ]


def hint(holder: Server, cached: int, **agent: Any) -> dict[str, Any]:
    """The router's hint naming `holder` (its advertised agent, or `agent` given)."""
    named = agent or info(holder)["memserve"]["agent"]
    return {"prefix_holders": [{"url": holder.url, "cached_tokens": cached, **named}]}


def generate(worker: Server, ids: list[int], max_new: int = 4, **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}, **extra}
    status, answer = call(worker.url + "/generate", body)
    assert status == 200, answer
    return answer


def cached_after(prompt: int, out: int) -> int:
    """Tokens a worker caches after a request: the whole pages with KV (the last output
    token has none)."""
    return (prompt + out - 1) // PAGE * PAGE


def pull_stats(worker: Server) -> dict[str, Any]:
    stats: dict[str, Any] = info(worker)["pull"]
    return stats


def protected(worker: Server) -> int:
    pages: int = info(worker)["mempool"]["protected_pages"]
    return pages


def no_leak(*workers: Server) -> None:
    """On each worker, every allocated block is indexed cache, and nothing is pinned: no
    request, pull or peer holds anything."""
    for worker in workers:
        used, cached = used_pages(worker)
        assert used == cached, (worker.url, used, cached)
        assert protected(worker) == 0, worker.url


def idle(worker: Server) -> bool:
    """Its pull settled and no request left: a request whose client left still runs to its
    end after the pull, allocating as it goes; between the two, used == cached briefly."""
    stats = pull_stats(worker)
    settled = stats["pulls"] + stats["failures"] + stats["empty"] + stats["refused_slower"]
    load = call(worker.url + "/get_load")[1][0]
    used, cached = used_pages(worker)
    busy = load["num_reqs"] or load["num_waiting_reqs"]
    return settled >= 1 and not busy and used == cached


@contextlib.contextmanager
def frozen(server: Server) -> Iterator[None]:
    """SIGSTOP for the block (alive, sockets open, never answering), then SIGCONT."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def warm(holder: Server, seed: int, n: int = 1000) -> tuple[list[int], int]:
    """A prompt the holder computed and caches; (prompt, tokens it caches)."""
    ids = prompt_ids(seed, n)
    out = generate(holder, ids)
    assert out["meta_info"]["pulled_tokens"] == 0
    return ids, cached_after(n, len(out["output_ids"]))


@pytest.fixture(scope="module")
def pair(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    """A holder and a puller, both with pulls on (time not slept) and adapter `lora-a`."""
    logs = tmp_path_factory.mktemp("pull-pair")
    args = sim_args(model_dir, "--lora-paths", "lora-a=/adapters/a")
    with (
        running("connector.worker", args, logs) as holder,
        running("connector.worker", args, logs) as puller,
    ):
        yield holder, puller


def test_a_puller_reads_what_it_lacks_and_computes_only_the_rest(
    pair: tuple[Server, Server],
) -> None:
    holder, puller = pair
    assert info(puller)["memserve"]["kv_pull"] is True
    agent = info(holder)["memserve"]["agent"]
    assert set(agent) == {"instance_id", "host", "port"} and agent["host"] == "127.0.0.1"
    assert agent["instance_id"] != info(puller)["memserve"]["agent"]["instance_id"]
    before_p, before_h = pull_stats(puller), pull_stats(holder)
    verified = info(puller)["backend"]["verified_pages"]

    ids, held = warm(holder, 1)
    assert held == 992
    asked = ids + prompt_ids(2, 100)
    got = generate(puller, asked, memserve=hint(holder, held))
    meta = got["meta_info"]
    assert meta["pulled_tokens"] == held and meta["cached_tokens"] == 0
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0}
    # The pulled pages carried the holder's stamps (each page's hash), checked before use.
    assert info(puller)["backend"]["verified_pages"] - verified == held // PAGE
    after_p, after_h = pull_stats(puller), pull_stats(holder)
    assert after_p["pulls"] - before_p["pulls"] == 1
    assert after_p["pulled_tokens"] - before_p["pulled_tokens"] == held
    assert after_p["bytes"] - before_p["bytes"] == held // PAGE * 256  # stand-in pages
    assert after_p["failures"] == before_p["failures"]
    assert after_p["modelled_s"] > before_p["modelled_s"]  # counted, not slept (scale 0)
    assert after_h["served"] - before_h["served"] == 1
    assert after_h["served_locked_tokens"] - before_h["served_locked_tokens"] == held

    # The same prompt again: now a local hit, nothing pulled (the hint is no longer longer).
    again = generate(puller, asked, memserve=hint(holder, held))
    assert again["meta_info"]["pulled_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == cached_after(len(asked), 4)
    assert again["output_ids"] == got["output_ids"]
    assert pull_stats(puller)["pulls"] == after_p["pulls"]
    no_leak(holder, puller)


def test_only_the_missing_pages_move_when_part_is_cached_locally(
    pair: tuple[Server, Server],
) -> None:
    holder, puller = pair
    ids, held = warm(holder, 3)
    local = generate(puller, ids[:500])  # the puller has the first 31 pages itself
    assert local["meta_info"]["cached_tokens"] == 0
    before = pull_stats(puller)
    got = generate(puller, ids + [7] * 40, memserve=hint(holder, held))
    meta = got["meta_info"]
    assert meta["cached_tokens"] == 496  # its own pages
    assert meta["pulled_tokens"] == held - 496  # the holder's, after them
    assert pull_stats(puller)["bytes"] - before["bytes"] == (held - 496) // PAGE * 256
    no_leak(holder, puller)


def test_openai_usage_reports_pulled_tokens_apart_from_cached(
    pair: tuple[Server, Server],
) -> None:
    holder, puller = pair
    ids, held = warm(holder, 4, 600)
    body = {"prompt": [*ids, 11, 12, 13], "max_tokens": 3, "memserve": hint(holder, held)}
    status, answer = call(puller.url + "/v1/completions", body)
    assert status == 200, answer
    details = answer["usage"]["prompt_tokens_details"]
    assert details == {"cached_tokens": 0, "pulled_tokens": held, "written_back_tokens": 0}
    no_leak(puller)


def test_concurrent_pulls_of_one_prefix_all_answer(pair: tuple[Server, Server]) -> None:
    holder, puller = pair
    ids, held = warm(holder, 5)
    tails = [prompt_ids(50 + i, 30) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda t: generate(puller, ids + t, memserve=hint(holder, held)), tails)
        )
    for answer in answers:  # each found the prefix pulled, by itself or by another
        meta = answer["meta_info"]
        assert meta["pulled_tokens"] + meta["cached_tokens"] == held, meta
    assert sum(a["meta_info"]["pulled_tokens"] for a in answers) >= held
    no_leak(holder, puller)


def test_a_stale_hint_costs_a_recompute(pair: tuple[Server, Server]) -> None:
    holder, puller = pair
    ids, held = warm(holder, 6)
    assert call(holder.url + "/flush_cache", method="POST", raw=b"")[0] == 200
    before = pull_stats(puller)
    got = generate(puller, ids + [9] * 20, memserve=hint(holder, held))
    assert got["meta_info"]["pulled_tokens"] == 0 == got["meta_info"]["cached_tokens"]
    after = pull_stats(puller)
    assert after["empty"] - before["empty"] == 1 and after["failures"] == before["failures"]
    no_leak(holder, puller)


def test_a_salted_prompt_pulls_its_own_namespaces_pages_and_never_anothers(
    pair: tuple[Server, Server],
) -> None:
    """A pull asks by the request's index key: tenant B, named the holder of tenant A's
    identical prompt, gets nothing (the pull finds no page, B computes it all); tenant A's
    own next request on the other worker pulls it, and the pulled pages stay in A's
    namespace there (a request without the salt finds none)."""
    holder, puller = pair
    ids = prompt_ids(21, 1000)
    first = generate(holder, ids, cache_salt="tenant-a")
    held = cached_after(len(ids), len(first["output_ids"]))
    asked = ids + prompt_ids(22, 60)
    before = pull_stats(puller)
    other = generate(puller, asked, cache_salt="tenant-b", memserve=hint(holder, held))
    assert other["meta_info"]["pulled_tokens"] == 0 == other["meta_info"]["cached_tokens"]
    assert pull_stats(puller)["empty"] - before["empty"] == 1
    own = generate(puller, asked, cache_salt="tenant-a", memserve=hint(holder, held))
    assert own["meta_info"]["pulled_tokens"] == held
    assert own["meta_info"]["cached_tokens"] == 0
    again = generate(puller, asked, cache_salt="tenant-a")
    assert again["meta_info"]["cached_tokens"] == cached_after(len(asked), 4)
    assert generate(puller, asked)["meta_info"]["cached_tokens"] == 0
    no_leak(holder, puller)


def test_a_public_prefix_is_pulled_across_tenants_and_the_text_after_it_is_not(
    pair: tuple[Server, Server],
) -> None:
    holder, puller = pair
    ids = prompt_ids(23, 1000)
    public = {"shared_prefix_tokens": 480}  # 30 pages, shared by every salt
    first = generate(holder, ids, cache_salt="tenant-a", **public)
    held = cached_after(len(ids), len(first["output_ids"]))
    asked = ids + prompt_ids(24, 60)
    got = generate(puller, asked, cache_salt="tenant-b", memserve=hint(holder, held), **public)
    assert got["meta_info"]["pulled_tokens"] == 480
    assert got["meta_info"]["cached_tokens"] == 0
    own = generate(puller, asked, cache_salt="tenant-a", memserve=hint(holder, held), **public)
    assert own["meta_info"]["cached_tokens"] == 480  # the public part, pulled for B
    assert own["meta_info"]["pulled_tokens"] == held - 480  # A's own text after it
    no_leak(holder, puller)


def test_pulled_salted_pages_count_toward_the_salts_share(
    model_dir: Path, tmp_path: Path, pair: tuple[Server, Server]
) -> None:
    """A worker holding each salt group to 768 tokens of its KV (`--max-cached-tokens-per-
    salt`) pulls two 512-token prompts of tenant A: the second puts A over its share, so the
    first goes, as if it had been computed there (uncharged, a pull would let a tenant hold
    any share of a worker's cache)."""
    holder = pair[0]
    capped = sim_args(model_dir, "--max-cached-tokens-per-salt", "768")
    with running("connector.worker", capped, tmp_path) as puller:
        first, second = prompt_ids(27, 512), prompt_ids(28, 512)
        for ids in (first, second):
            held = cached_after(len(ids), len(generate(holder, ids, cache_salt="a")["output_ids"]))
            got = generate(puller, ids + [7], cache_salt="a", memserve=hint(holder, held))
            assert got["meta_info"]["pulled_tokens"] == held
        again = generate(puller, second + [7], max_new=1, cache_salt="a")["meta_info"]
        assert again["cached_tokens"] == 512
        again = generate(puller, first + [7], max_new=1, cache_salt="a")["meta_info"]
        assert again["cached_tokens"] == 0  # over the share: the oldest path went


def test_an_adapters_prompt_is_never_pulled(pair: tuple[Server, Server]) -> None:
    """An adapter's pages are keyed by each worker's own load of it: a hint naming a holder
    of the same adapter's prompt is ignored (no pull tried), the prompt computed."""
    holder, puller = pair
    ids = prompt_ids(25, 1000)
    first = generate(holder, ids, lora_path="lora-a")
    held = cached_after(len(ids), len(first["output_ids"]))
    before = pull_stats(puller)
    got = generate(
        puller, ids + prompt_ids(26, 60), lora_path="lora-a", memserve=hint(holder, held)
    )
    assert got["meta_info"]["pulled_tokens"] == 0 == got["meta_info"]["cached_tokens"]
    after = pull_stats(puller)
    assert {k: after[k] - before[k] for k in ("pulls", "empty", "failures")} == dict.fromkeys(
        ("pulls", "empty", "failures"), 0
    )
    no_leak(puller)


@pytest.mark.parametrize(
    ("memserve", "message"),
    [
        ("holders", "'memserve' must be an object"),
        ({"prefix_holders": {"a": 1}}, "'memserve.prefix_holders' must be a list"),
        ({"prefix_holders": [7]}, "prefix_holders[0] must be an object"),
        ({"prefix_holders": [{"instance_id": 3}]}, "cached_tokens must be an integer"),
        (
            {"prefix_holders": [{"cached_tokens": -1, "instance_id": 3}]},
            "cached_tokens must be an integer >= 0",
        ),
        (
            {"prefix_holders": [{"cached_tokens": 32, "instance_id": True}]},
            "instance_id must be an integer",
        ),
        (
            {"prefix_holders": [{"cached_tokens": 32, "instance_id": 70000}]},
            "instance_id must be at most 65535",
        ),
        (
            {"prefix_holders": [{"cached_tokens": 32, "instance_id": 3, "port": 0}]},
            "port must be an integer >= 1",
        ),
        (
            {"prefix_holders": [{"cached_tokens": 32, "instance_id": 3, "host": 5}]},
            "host must be a string",
        ),
    ],
)
def test_a_malformed_hint_is_a_400(
    pair: tuple[Server, Server], memserve: Any, message: str
) -> None:
    _, puller = pair
    body = {"input_ids": prompt_ids(7, 40), "memserve": memserve}
    status, answer = call(puller.url + "/generate", body)
    assert status == 400, answer
    assert message in answer["message"]
    no_leak(puller)


def test_holders_without_an_agent_or_a_shorter_prefix_are_not_pulled_from(
    pair: tuple[Server, Server],
) -> None:
    holder, puller = pair
    ids, held = warm(holder, 8, 300)
    generate(puller, ids)  # the puller caches as much as the holder
    before = pull_stats(puller)
    hints = [
        {"prefix_holders": [{"url": holder.url, "cached_tokens": 5000}]},  # no agent
        hint(holder, held),  # no longer than the local match
        {"prefix_holders": []},
    ]
    for k, named in enumerate(hints):
        got = generate(puller, ids + [3 + k] * 20, memserve=named)
        assert got["meta_info"]["pulled_tokens"] == 0
        assert got["meta_info"]["cached_tokens"] == held
    assert pull_stats(puller) == before
    no_leak(puller)


def test_pull_decision_follows_the_latency_model_and_its_time_is_slept(
    model_dir: Path, tmp_path: Path
) -> None:
    # 28 Gb/s: 37 us a token of KV on the wire against 40 us (plus attention) to prefill it,
    # after 100 us per transfer; one page does not pay, 62 do. Time scale 5: the wire time is
    # slept x5.
    scale = 5.0
    with (
        running("connector.worker", sim_args(model_dir), tmp_path) as holder,
        running(
            "connector.worker",
            sim_args(model_dir, "--sim-interconnect-gbps", "28", time_scale=str(scale)),
            tmp_path,
        ) as puller,
    ):
        model = info(puller)["backend"]["latency_model"]
        page_bytes = info(puller)["backend"]["modelled_kv_page_bytes"]
        assert model["interconnect_bytes_per_s"] == 28e9 / 8

        def wire(pages: int) -> float:
            return (
                model["transfer_latency_s"] + pages * page_bytes / model["interconnect_bytes_per_s"]
            )

        def prefill(new: int, cached: int) -> float:
            pairs = new * (cached + new / 2)
            return new * model["prefill_per_token_s"] + pairs * model["prefill_per_token_pair_s"]

        assert wire(1) > prefill(PAGE, 976)  # the premises of this test
        assert wire(62) < prefill(992, 0)

        ids, held = warm(holder, 10)
        generate(puller, ids[:980])  # the puller holds 61 pages: 1 missing
        got = generate(puller, ids + [5] * 30, memserve=hint(holder, held))
        assert got["meta_info"]["pulled_tokens"] == 0
        assert got["meta_info"]["cached_tokens"] == 976
        stats = pull_stats(puller)
        assert stats["refused_slower"] == 1 and stats["pulls"] == 0
        assert pull_stats(holder)["served"] == 0  # the holder was not even asked

        ids2, held2 = warm(holder, 11)
        got = generate(puller, ids2 + [5] * 30, memserve=hint(holder, held2))
        assert got["meta_info"]["pulled_tokens"] == held2 == 992
        stats = pull_stats(puller)
        assert stats["pulls"] == 1 and stats["refused_slower"] == 1
        assert stats["modelled_s"] == pytest.approx(wire(62), rel=1e-4)
        assert info(puller)["memserve"]["transfer_time"].startswith("modelled")
        assert stats["wall_s"] >= wire(62) * scale  # slept between allocation and data
        rest = prefill(len(ids2) + 30 - 992, 992)
        assert got["meta_info"]["e2e_latency"] >= (wire(62) + rest) * scale
        no_leak(holder)
        no_leak(puller)


@pytest.fixture(scope="module")
def puller(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(
        "connector.worker", sim_args(model_dir), tmp_path_factory.mktemp("puller")
    ) as server:
        yield server


HOLDER_FAULTS = ["killed", "frozen", "wrong_secret", "unknown_agent", "no_address"]


@pytest.mark.parametrize("fault", HOLDER_FAULTS)
def test_a_failing_holder_costs_a_recompute_not_the_request(
    model_dir: Path, tmp_path: Path, puller: Server, fault: str
) -> None:
    holder_args = sim_args(model_dir)
    if fault == "wrong_secret":
        holder_args[holder_args.index(SECRET)] = "another-secret"
    with running("connector.worker", holder_args, tmp_path) as holder:
        seed = 100 * (1 + HOLDER_FAULTS.index(fault))  # own prompts: the puller outlives us
        ids, held = warm(holder, seed)
        later, held_later = warm(holder, seed + 1)
        named = hint(holder, held)
        if fault in ("killed", "frozen"):  # a working link first: the fault hits it
            assert (
                generate(puller, ids + [1] * 20, memserve=named)["meta_info"]["pulled_tokens"]
                == held
            )
        named = hint(holder, held_later)
        if fault == "unknown_agent":  # an agent nobody runs: nothing listens there
            named = hint(holder, held_later, instance_id=4242, host="127.0.0.1", port=free_port())
        elif fault == "no_address":  # an id without an address, and no membership to ask
            named = hint(holder, held_later, instance_id=4243)
        before = pull_stats(puller)
        with frozen(holder) if fault == "frozen" else contextlib.nullcontext():
            if fault == "killed":
                kill(holder)
            started = time.monotonic()
            got = generate(puller, later + [2] * 20, memserve=named)
            elapsed = time.monotonic() - started
        meta = got["meta_info"]
        assert meta["pulled_tokens"] == 0 == meta["cached_tokens"]  # recomputed
        assert elapsed < TIMEOUT + 2.5, elapsed
        if fault == "frozen":
            assert elapsed >= TIMEOUT * 0.9  # it waited for the holder, as long as allowed
        after = pull_stats(puller)
        assert after["failures"] - before["failures"] == 1
        assert after["pulls"] == before["pulls"]
        why = after["last_failure"]
        expected = {
            "killed": "instance",
            "frozen": f"no pull within {TIMEOUT:g} s",
            "wrong_secret": "secrets differ",
            "unknown_agent": "unreachable",
            "no_address": "instance 4243 is not a live member",
        }[fault]
        assert expected in why, why
        no_leak(puller)
        if fault != "killed":
            # The holder's lock (taken after it woke, for a puller long gone) is released.
            wait_for("the holder's pages unlocked", lambda: protected(holder) == 0, 10)
            no_leak(holder)
            if fault == "frozen":  # the holder serves pulls again
                third, held3 = warm(holder, seed + 2)
                again = generate(puller, third + [4] * 20, memserve=hint(holder, held3))
                assert again["meta_info"]["pulled_tokens"] == held3


@pytest.mark.parametrize("fault", ["killed", "frozen", "client_left"])
def test_a_fault_in_the_middle_of_a_pull_frees_everything(
    model_dir: Path, tmp_path: Path, fault: str
) -> None:
    # 30 Gb/s at time scale 60: the 62 pages' wire time (35 ms modelled) is slept for 2 s
    # between the puller's allocation and the data, while the holder keeps its prefix locked.
    with (
        running("connector.worker", sim_args(model_dir), tmp_path) as holder,
        running(
            "connector.worker",
            sim_args(model_dir, "--sim-interconnect-gbps", "30", time_scale="60"),
            tmp_path,
        ) as puller,
    ):
        ids, held = warm(holder, 30)
        body = {
            "input_ids": ids + [6] * 20,
            "sampling_params": {"max_new_tokens": 2},
            "memserve": hint(holder, held),
        }
        with ThreadPoolExecutor(1) as pool:
            timeout = 1.0 if fault == "client_left" else 60
            answer = pool.submit(call, puller.url + "/generate", body, timeout=timeout)
            wait_for("the holder's lock", lambda: protected(holder) == held // PAGE)
            used, cached = used_pages(puller)
            assert used - cached == held // PAGE  # the puller allocated the pages
            with frozen(holder) if fault == "frozen" else contextlib.nullcontext():
                if fault == "killed":
                    kill(holder)
                if fault == "client_left":
                    with pytest.raises(TimeoutError):
                        answer.result()
                else:
                    status, got = answer.result()
        if fault != "client_left":
            assert status == 200, got
            assert got["meta_info"]["pulled_tokens"] == 0 == got["meta_info"]["cached_tokens"]
            assert pull_stats(puller)["failures"] == 1
        wait_for("the puller idle", lambda: idle(puller))
        no_leak(puller)
        if fault != "killed":
            wait_for("the holder's pages unlocked", lambda: protected(holder) == 0, 10)
            no_leak(holder)
        assert call(puller.url + "/health")[0] == 200


def test_holders_found_in_redis_membership(
    model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    member = ("--cluster-redis", redis_server.url)
    with (
        running("connector.worker", sim_args(model_dir, *member), tmp_path) as holder,
        running("connector.worker", sim_args(model_dir, *member), tmp_path) as puller,
    ):
        assert info(puller)["memserve"]["membership"] == redis_server.url
        iid = info(holder)["memserve"]["agent"]["instance_id"]
        taken = {iid, info(puller)["memserve"]["agent"]["instance_id"]}
        unknown = next(i for i in range(1, 100) if i not in taken)
        ids, held = warm(holder, 40)
        # the hint names the instance only: its address comes from membership
        named = {"prefix_holders": [{"cached_tokens": held, "instance_id": iid}]}
        got = generate(puller, ids + [8] * 20, memserve=named)
        assert got["meta_info"]["pulled_tokens"] == held
        stranger = {"prefix_holders": [{"cached_tokens": held, "instance_id": unknown}]}
        later, _ = warm(holder, 41)
        got = generate(puller, later + [8] * 20, memserve=stranger)
        assert got["meta_info"]["pulled_tokens"] == 0
        assert "is not a live member" in pull_stats(puller)["last_failure"]
        no_leak(holder)
        no_leak(puller)


def test_a_worker_without_pulls_says_so_and_ignores_hints(
    model_dir: Path, tmp_path: Path, pair: tuple[Server, Server]
) -> None:
    holder, _ = pair
    plain = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    with running("connector.worker", plain, tmp_path) as worker:
        described = info(worker)
        assert described["memserve"] == {"kv_pull": False, "serves_pulls": False}
        assert described["pull"]["pulls"] == 0
        ids, held = warm(holder, 50, 200)
        got = generate(worker, ids + [1] * 20, memserve=hint(holder, held))
        assert got["meta_info"]["pulled_tokens"] == 0 == got["meta_info"]["cached_tokens"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--disable-radix-cache",), "--enable-mempool-pull needs the radix cache"),
        (("--mempool-pull-timeout-secs", "0"), "--mempool-pull-timeout-secs must be positive"),
    ],
)
def test_pull_flags_that_cannot_work_are_a_one_line_start_error(
    model_dir: Path, extra: tuple[str, ...], message: str
) -> None:
    cmd = [sys.executable, "-m", "connector.worker", "--port", str(free_port())]
    cmd += sim_args(model_dir, *extra)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
