"""The floors of a LoRA run: the adapter loads no router avoids, and the ideal queue that
places each request where it starts soonest counting its adapter's load."""

from __future__ import annotations

import pytest

from benchmarks.multiturn.adapter_floor import AdapterSlots, RunAdapters, adapter_fcfs_ttfts
from benchmarks.multiturn.floor import Floor
from benchmarks.multiturn.queue_floor import queued_floor_stats
from connector.worker.latency_model import LatencyModel

LOAD = 0.5


def test_only_the_first_request_for_an_adapter_no_worker_held_pays_a_load() -> None:
    run = RunAdapters(["a", "b", "b", None, "c", "b"], [["a"], []], capacity=2, load_s=LOAD)
    # "a" was loaded at the start; "b" is first named by rid 2 (sent before rid 1); the base
    # model loads nothing; rid 4 was never sent
    sent: list[float | None] = [0.0, 2.0, 1.0, 3.0, None, 4.0]
    assert run.unavoidable_s(sent) == [0.0, 0.0, LOAD, 0.0, 0.0, 0.0]


def test_a_request_goes_where_it_starts_soonest_counting_its_load() -> None:
    slots = AdapterSlots.at_start([["a"], []], capacity=2, load_s=LOAD)
    # rid 0 ("a") on worker 0 at once; rid 1 ("b") on the idle worker 1, loading "b";
    # rid 2 ("a") waits for worker 0 (free at 1.0) rather than load "a" on worker 1
    ttfts = adapter_fcfs_ttfts([0.0, 0.0, 0.1], [1.0, 1.0, 1.0], ["a", "b", "a"], slots)
    assert ttfts == pytest.approx([1.0, 1.0 + LOAD, 1.9])
    assert list(slots.workers[1].resident) == ["b"]


def test_past_the_limit_the_least_recently_used_adapter_gives_way() -> None:
    slots = AdapterSlots.at_start([["a", "b"]], capacity=2, load_s=LOAD)
    # "a" used, then "c" evicts "b" (least recently used), so "b" loads again
    ttfts = adapter_fcfs_ttfts([0.0, 10.0, 20.0], [1.0, 1.0, 1.0], ["a", "c", "b"], slots)
    assert ttfts == pytest.approx([1.0, 1.0 + LOAD, 1.0 + LOAD])
    assert list(slots.workers[0].resident) == ["c", "b"]


@pytest.mark.parametrize(
    ("at_start", "capacity", "message"),
    [([], 4, "at least one worker"), ([[]], 0, "at least one adapter")],
)
def test_slots_without_a_worker_or_a_slot_are_refused(
    at_start: list[list[str]], capacity: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        AdapterSlots.at_start(at_start, capacity, LOAD)


def test_unpaired_lists_are_refused() -> None:
    slots = AdapterSlots.at_start([[]], None, LOAD)
    with pytest.raises(ValueError, match="2 arrivals, 1 services, 2 adapters"):
        adapter_fcfs_ttfts([0.0, 1.0], [1.0], ["a", "b"], slots)


def test_the_floor_reads_the_load_from_the_worker_and_charges_it_once() -> None:
    model = LatencyModel()
    info = {"backend": {"time_scale": 4.0, "lora_bytes": 84e6}, "chunked_prefill_size": 0}
    floor = Floor.of_worker(info)
    assert floor.lora_load_s == pytest.approx(4 * (model.lora_load_latency_s + 84e6 / 2e9))
    assert Floor.of_worker({"backend": {"time_scale": 4.0}}).lora_load_s == 0.0
    run = RunAdapters(["x", "x"], [["a"]], capacity=2, load_s=floor.lora_load_s)
    sent: list[float | None] = [0.0, 5.0]
    lengths: list[int | None] = [1000, 1000]
    hits: list[int | None] = [0, 0]
    alone = floor.ttft_s(1000, 0)
    stats = floor.stats(hits, lengths, [0, 1], run.unavoidable_s(sent))
    assert stats["floor_ttft_mean_s"] == pytest.approx(alone + floor.lora_load_s / 2)
    queued = queued_floor_stats(floor, hits, lengths, sent, [0, 1], 1, adapters=run)
    assert queued["queue_floor_ttft_mean_s"] == pytest.approx(alone + floor.lora_load_s / 2)
    # without the adapters the queue pays no load at all
    blind = queued_floor_stats(floor, hits, lengths, sent, [0, 1], 1)
    assert blind["queue_floor_ttft_mean_s"] == pytest.approx(alone)
