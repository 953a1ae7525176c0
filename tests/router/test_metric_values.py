"""A router process's metric values: counted as the library counts, written when told."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.multiprocess import MultiProcessCollector

from router.metric_values import LoopValue, use_buffered_files, use_loop_values, write_buffered


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's value class back as it was after the test."""
    monkeypatch.setattr(prometheus_values, "ValueClass", prometheus_values.ValueClass)


def sample(text: bytes, name: str) -> float:
    line = next(x for x in text.decode().splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


@pytest.mark.usefixtures("restored")
def test_loop_values_count_as_the_librarys() -> None:
    use_loop_values()
    registry = CollectorRegistry()
    counter = Counter("answers", "answers", registry=registry)
    histogram = Histogram("seconds", "seconds", registry=registry, buckets=(0.1, 1.0))
    assert isinstance(counter._value, LoopValue)
    counter.inc()
    counter.inc(2)
    for x in (0.05, 0.5, 5.0):
        histogram.observe(x)
    page = generate_latest(registry)
    assert sample(page, "answers_total") == 3
    assert sample(page, "seconds_count") == 3
    assert sample(page, "seconds_sum") == pytest.approx(5.55)
    assert b'seconds_bucket{le="1.0"} 2.0' in page


@pytest.mark.usefixtures("restored")
def test_buffered_increments_reach_the_files_when_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several processes: what one counted is in its file once written (each /metrics
    answer and the router's once-a-second sync write it), not on every increment."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    use_buffered_files(os.getpid())
    counter = Counter("buffered_answers", "answers", ["worker"], registry=CollectorRegistry())

    def summed() -> float:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path))
        return sample(generate_latest(registry), 'buffered_answers_total{worker="a"}')

    counter.labels("a").inc(2)
    write_buffered()
    assert summed() == 2
    counter.labels("a").inc(3)
    assert summed() == 2  # (in memory)
    assert counter.labels("a")._value.get() == 5
    write_buffered()
    assert summed() == 5
