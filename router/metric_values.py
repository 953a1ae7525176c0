"""Where a router process keeps its Prometheus counts: cheaper values than the library's.

A request moves about ten counters and histograms. prometheus-client guards each value with
a lock, and in multiprocess mode also writes it to its mmapped file on every increment:
about 0.3 µs an increment in one process, more with the files (measured at max rate, a
2-process router spent 5 µs a request less with the writes buffered: as little as with no
metrics at all). Every count of a router process is moved on its event loop's thread (the
encode thread and granian's threads touch none), so:

- one process (`use_loop_values`): values without a lock;
- several processes (`use_buffered_files`): increments stay in memory and go to the files
  in `write_buffered`, which the router calls about once a second and before each /metrics
  answer (router.metrics.RouterMetrics.sync), as it already does for its tree counts. A
  scrape answered by one process sees the others' counts of up to a second ago.

Both go through `prometheus_client.values.ValueClass`, which the library reads whenever it
makes a value: set before the router's metrics are made.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import values as prometheus_values

_unwritten: set[Any] = set()  # buffered values changed since the last write


class LoopValue:
    """prometheus-client's value interface, for one thread: no lock."""

    _multiprocess = False
    __slots__ = ("_exemplar", "_value")

    def __init__(self, *_: Any, **__: Any) -> None:
        self._value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


def use_loop_values() -> None:
    """This process's metrics made from now on use `LoopValue` (a single router process)."""
    prometheus_values.ValueClass = LoopValue


def use_buffered_files(pid: int) -> None:
    """This process's metrics made from now on keep their increments in memory until
    `write_buffered` (a router process among several: PROMETHEUS_MULTIPROC_DIR is set).
    `pid` is read once: router processes are started by exec, never forked, and the
    library's check for a fork on every increment is a getpid() call."""
    files = prometheus_values.MultiProcessValue(lambda: pid)  # type: ignore[no-untyped-call]

    class BufferedValue(files):  # type: ignore[misc, valid-type]
        def inc(self, amount: float) -> None:
            self._value += amount
            self._timestamp = 0.0
            _unwritten.add(self)

    prometheus_values.ValueClass = BufferedValue


def write_buffered() -> None:
    """Write the buffered increments to this process's metric files."""
    for value in _unwritten:
        value._file.write_value(value._key, value._value, value._timestamp)
    _unwritten.clear()
