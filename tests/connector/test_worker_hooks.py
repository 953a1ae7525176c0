"""ChainedHooks: several deployments' hooks on one instance (a PD prefill that pulls)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from connector.worker.hooks import ChainedHooks, RequestHooks


class Recorded(RequestHooks):
    """Hooks that log what they were asked and take what they are told to."""

    def __init__(self, name: str, log: list[str], takes: bool = False, fails: bool = False):
        self.name, self.log, self.takes, self.fails = name, log, takes, fails

    def on_submit(self, seq: Any, extras: dict[str, Any], engine: Any) -> bool:
        self.log.append(f"submit {self.name}")
        return self.takes

    def on_finish(self, seq: Any, cache: bool, engine: Any) -> bool:
        self.log.append(f"finish {self.name}")
        return self.takes

    async def start(self) -> None:
        if self.fails:
            raise OSError(f"{self.name} cannot start")
        self.log.append(f"start {self.name}")

    async def close(self) -> None:
        self.log.append(f"close {self.name}")

    def info(self) -> dict[str, Any] | None:
        return {"from": self.name} if self.name == "pd" else None

    def server_info(self) -> dict[str, Any]:
        return {"memserve": {"from": self.name}, self.name: True}


SEQ: Any = None  # the chain hands them on untouched
ENGINE: Any = None


def test_the_first_hooks_to_take_a_request_end_the_chain() -> None:
    log: list[str] = []
    chain = ChainedHooks([Recorded("pd", log), Recorded("pull", log, takes=True)])
    assert chain.on_submit(SEQ, {}, ENGINE) is True
    assert chain.on_finish(SEQ, True, ENGINE) is True
    assert log == ["submit pd", "submit pull", "finish pd", "finish pull"]
    log.clear()
    taken = ChainedHooks([Recorded("pd", log, takes=True), Recorded("pull", log)])
    assert taken.on_submit(SEQ, {}, ENGINE) is True and log == ["submit pd"]
    assert ChainedHooks([Recorded("pd", log)]).on_finish(SEQ, True, ENGINE) is False


def test_reports_merge_with_the_later_hooks_winning() -> None:
    chain = ChainedHooks([Recorded("pd", []), Recorded("pull", [])])
    assert chain.info() == {"from": "pd"}
    assert chain.server_info() == {"memserve": {"from": "pull"}, "pd": True, "pull": True}


def test_a_failed_start_closes_what_started_in_reverse() -> None:
    log: list[str] = []
    chain = ChainedHooks([Recorded("a", log), Recorded("b", log), Recorded("c", log, fails=True)])
    with pytest.raises(OSError, match="c cannot start"):
        asyncio.run(chain.start())
    assert log == ["start a", "start b", "close b", "close a"]
    log.clear()
    asyncio.run(ChainedHooks([Recorded("a", log), Recorded("b", log)]).close())
    assert log == ["close b", "close a"]
    with pytest.raises(ValueError, match="at least one"):
        ChainedHooks([])
