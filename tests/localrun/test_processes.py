"""Free ports for servers started as processes: the benchmarks start a dozen at once, and a
port that two of them get, or that a connection takes before its server binds, fails a run."""

from __future__ import annotations

import socket

import pytest

from localrun import processes as procs
from localrun.processes import LOOPBACK, ephemeral_ports, free_port


def test_ports_are_never_handed_out_twice() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_ports_are_outside_the_range_connections_take_their_source_ports_from() -> None:
    low, high = ephemeral_ports()
    assert low < high
    ports = [free_port() for _ in range(50)]
    assert not [p for p in ports if low <= p <= high]


def listen_below_the_ephemeral_range() -> socket.socket:
    """A listener on the first port from where free_port picks that nobody holds."""
    for port in range(procs.FIRST_PICKED_PORT, ephemeral_ports()[0]):
        s = socket.socket()
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            s.close()
            continue
        s.listen()
        return s
    raise AssertionError("no port below the ephemeral range is free")


def bindable_port_other_than(taken: int) -> int:
    """A port below the ephemeral range, other than `taken`, that a listener could take."""
    for port in range(procs.FIRST_PICKED_PORT, ephemeral_ports()[0]):
        if port != taken and procs.can_bind(port):
            return port
    raise AssertionError("no second port below the ephemeral range is free")


def test_a_port_someone_listens_on_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fresh record of handed-out ports: earlier tests in the session may have had `free`.
    monkeypatch.setattr(procs, "_picked_ports", set())
    with listen_below_the_ephemeral_range() as listener:
        taken = listener.getsockname()[1]
        free = bindable_port_other_than(taken)
        picks = iter([taken, taken, free])
        monkeypatch.setattr(procs._port_random, "randrange", lambda low, high: next(picks))
        assert free_port() == free


def test_a_port_already_handed_out_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    handed_out = bindable_port_other_than(0)
    monkeypatch.setattr(procs, "_picked_ports", {handed_out})
    free = bindable_port_other_than(handed_out)
    picks = iter([handed_out, free])
    monkeypatch.setattr(procs._port_random, "randrange", lambda low, high: next(picks))
    assert free_port() == free


def test_a_server_can_bind_the_port_it_is_handed() -> None:
    with socket.socket() as s:
        s.bind((LOOPBACK, free_port()))
        s.listen()
        with socket.create_connection(s.getsockname(), timeout=5):
            pass


def test_a_named_slice_keeps_every_pick_inside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """MEMSERVE_PORT_RANGE: test runs side by side (xdist workers) pick in disjoint slices."""
    low = procs.FIRST_PICKED_PORT + 3000
    monkeypatch.setenv(procs.PORT_RANGE_ENV, f"{low}-{low + 1500}")
    ports = [free_port() for _ in range(100)]
    assert all(low <= p < low + 1500 for p in ports), ports
