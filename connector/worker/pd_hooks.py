"""The scheduler's steps for one side of a disaggregated pair (SGLang's PD, MemServe's caching).

A request carrying SGLang's bootstrap fields is taken over at two points. On submit: a
prefill instance computes only its first token; a decode instance does not queue it but
waits for its room's KV from the prefill instance and has it join the running batch already
prefilled. On finish: a prefill instance stores every prompt page (the partial last one too),
pins it and pushes it to the decode instance; a PD-Caching-3 decode instance caches its KV,
pinned, answers the client and then writes the KV back to the prefill instance. Blocks stay
pinned until their transfer ends; every failure frees them and says why.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from connector.worker.hooks import Engine, RequestHooks, agent_address, no_pulls
from connector.worker.pd import Arrival, Bootstrap, PDLink, PDMode, bootstrap_fields
from connector.worker.protocol import BadRequest, write_back_wanted
from connector.worker.sequence import DONE, Sequence
from mempool import InsertResult, PrefixMatch

log = logging.getLogger(__name__)


def fail_handoff(seq: Sequence, why: str) -> None:
    """The request's KV could not move between the instances: it ends with `why`."""
    seq.handoff_error = why
    seq.finish_reason = {"type": "abort", "message": why}
    log.warning("request %s (bootstrap_room %s): KV hand-off failed: %s", seq.rid, seq.room, why)


class PDHooks(RequestHooks):
    """Owns this instance's `PDLink` and runs the PD side of its requests."""

    def __init__(self, link: PDLink) -> None:
        if link.config.mode is PDMode.NULL:
            raise ValueError("PD hooks need a prefill or decode instance")
        self.link = link
        self.mode = link.config.mode
        self.caching = link.config.caching

    async def start(self) -> None:
        await self.link.start()

    async def close(self) -> None:
        await self.link.close()

    def info(self) -> dict[str, Any]:
        return self.link.info()

    def server_info(self) -> dict[str, Any]:
        """A side that caches serves its cached prefixes to peers' pulls through its PD
        agent (a decode of PD-Caching-2/3 to the prefills, say); it pulls nothing itself."""
        agent = self.link.agent
        side = (
            self.caching.prefill_caches
            if self.mode is PDMode.PREFILL
            else self.caching.decode_caches
        )
        if agent is None or self.link.fake or not side:
            return super().server_info()
        return {
            "memserve": {"kv_pull": False, "serves_pulls": True, "agent": agent_address(agent)},
            "pull": {**no_pulls(), "served": agent.receiver.pulls_served},
        }

    # ----------------------------------------------------------------- submit

    def on_submit(self, seq: Sequence, extras: dict[str, Any], engine: Engine) -> bool:
        try:
            fields = bootstrap_fields(extras)
            write_back = write_back_wanted(extras)  # a malformed one is refused on either side
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if fields is None:  # no bootstrap fields: this instance serves the request alone
            return False
        if self.mode is PDMode.PREFILL:  # as SGLang's prefill: the first token only
            seq.sampling.max_new_tokens = min(seq.sampling.max_new_tokens, 1)
        if self.link.fake:  # SGLang's fake transfer backend: each side computes alone
            return False
        seq.room = fields.room
        if self.mode is PDMode.DECODE:
            seq.write_back = write_back
            self.link.spawn(self._receive(seq, fields, engine))
            return True
        return False

    async def _receive(self, seq: Sequence, fields: Bootstrap, engine: Engine) -> None:
        """Decode side: wait for the prefill's KV of the room, then decode from its token."""
        try:
            arrival = await self.link.receive(fields.room, fields.host, fields.port)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            fail_handoff(seq, str(exc))
            seq.events.put_nowait(DONE)
            return
        if seq.finish_reason is not None:  # the client left while the KV travelled
            self.link.free_received(arrival.received)
            seq.events.put_nowait(DONE)
            return
        try:
            self._adopt(seq, arrival, engine.kv.page)
            engine.join_prefilled(seq)
        except Exception as exc:
            self.link.free_received(arrival.received)
            seq.prefix, seq.blocks = None, []
            fail_handoff(seq, f"bad KV arrival: {exc}")
            seq.events.put_nowait(DONE)

    @staticmethod
    def _adopt(seq: Sequence, arrival: Arrival, page: int) -> None:
        """The arrived blocks become the request's KV: whole pages the index holds (pinned)
        as its prefix, the rest its own; the prefill's first token its first output."""
        got = arrival.received
        n = len(seq.prompt_ids)
        if got.num_tokens != n:
            raise ValueError(f"{got.num_tokens} tokens of KV arrived for a {n}-token prompt")
        whole = n // page if got.inserted else 0  # a prompt under a page inserts nothing
        if whole:
            if got.lock is None:
                raise ValueError("the prompt's pages were inserted but not pinned")
            seq.prefix = PrefixMatch(got.addrs[:whole], whole * page, got.lock.node, True)
        seq.blocks = list(got.addrs[whole:])
        seq.cached_tokens = whole * page
        seq.preloaded = n
        seq.reported_cached = arrival.prefill_cached
        seq.written_back_tokens = arrival.prefill_written_back
        seq.reported_pulled = arrival.prefill_pulled
        seq.prefill_id = arrival.prefill_id
        seq.output_ids.append(arrival.first_token)

    # ----------------------------------------------------------------- finish

    def on_finish(self, seq: Sequence, cache: bool, engine: Engine) -> bool:
        room = seq.room
        if room is None:
            return False
        ok = seq.prefilled and (seq.finish_reason or {}).get("type") != "abort"
        if self.mode is PDMode.PREFILL:
            if ok:
                self._hand_to_decode(seq, room, cache, engine)
                return True
            why = (seq.finish_reason or {}).get("message") or "the prefill did not finish"
            self.link.fail_room(room, why)  # the decode stops waiting now
            return False
        if (
            ok
            and seq.prefill_id is not None
            and cache
            and seq.write_back
            and self.caching.writeback
        ):
            self._write_back(seq, seq.prefill_id, engine)
            return True
        return False

    def _hand_to_decode(self, seq: Sequence, room: int, cache: bool, engine: Engine) -> None:
        """Prefill side: store every prompt page (partial last one too), pin it, push it."""
        kv, page = engine.kv, engine.kv.page
        n = len(seq.prompt_ids)
        cached_pages = seq.cached_tokens // page
        pages = -(-n // page)
        own = seq.blocks[: pages - cached_pages]
        spare = seq.blocks[pages - cached_pages :]
        pinned: InsertResult | None = None
        owned = seq.blocks  # what the request alone holds: freed if the hand-off fails
        try:
            addrs = (seq.prefix.addrs if seq.prefix is not None else []) + own
            whole = n // page
            unindexed, first_unindexed = own, cached_pages
            if cache and whole > cached_pages:  # whole pages become cache, pinned
                pinned = kv.keep_pinned(seq, whole, own[: whole - cached_pages])
                unindexed, first_unindexed = own[whole - cached_pages :], whole
                owned = unindexed + spare  # the index holds the rest now (or freed it)
                # The index's blocks: pages another request cached meanwhile replaced ours.
                addrs = kv.lookup(seq.prompt_ids[: whole * page], seq.namespace) + unindexed
            if unindexed:
                kv.write(seq, first_unindexed, unindexed, partial=True)
        except Exception as exc:
            log.exception("request %s: preparing its KV for the decode instance failed", seq.rid)
            fail_handoff(seq, f"preparing the KV failed: {exc}")
            self.link.fail_room(room, f"preparing the KV failed: {exc}")
            # Cached pages stay cache, unpinned; freeing them too was refused as a free of
            # indexed blocks (nothing freed, the pin kept for good).
            engine.retire(seq, owned, pinned)
            return
        seq.blocks = unindexed + spare
        self.link.spawn(self._push(seq, room, addrs, pinned, engine))

    async def _push(
        self,
        seq: Sequence,
        room: int,
        addrs: list[int],
        pinned: InsertResult | None,
        engine: Engine,
    ) -> None:
        try:
            await self.link.send(
                room,
                # Index keys: the decode inserts (and matches) the pages in its namespace.
                list(engine.kv.key(seq.prompt_ids, seq.namespace)),
                addrs,
                seq.output_ids[0],
                # What admission found, as a colocated answer reports it: a chunked prompt's
                # earlier chunks are cached (and its cached_tokens grown) as they are computed.
                seq.report_cached,
                seq.written_back_tokens,
                seq.pulled_tokens,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            fail_handoff(seq, str(exc))
            self.link.fail_room(room, str(exc))
        finally:
            engine.retire(seq, seq.blocks, pinned)

    def _write_back(self, seq: Sequence, prefill_id: int, engine: Engine) -> None:
        """PD-Caching-3 decode side: cache locally, pinned, and send it to the prefill."""
        kv, page = engine.kv, engine.kv.page
        cached_pages = seq.cached_tokens // page
        full = seq.num_computed // page
        adopt, rest = seq.blocks[: full - cached_pages], seq.blocks[full - cached_pages :]
        if full <= cached_pages:
            engine.retire(seq, rest)
            return
        try:
            pinned = kv.keep_pinned(seq, full, adopt)
        except Exception:
            log.exception("caching request %s failed", seq.rid)
            engine.retire(seq, seq.blocks)
            return
        tokens = list(kv.key(seq.all_ids[: full * page], seq.namespace))  # keyed, as inserted
        addrs = kv.lookup(tokens)  # the index's blocks (duplicates were freed)
        engine.retire(seq, rest)  # the client has its answer; the write-back runs after
        self.link.spawn(self._send_back(prefill_id, tokens, addrs, pinned, engine))

    async def _send_back(
        self,
        prefill_id: int,
        tokens: list[int],
        addrs: list[int],
        pinned: InsertResult,
        engine: Engine,
    ) -> None:
        try:
            await self.link.write_back(prefill_id, tokens, addrs)
        finally:
            engine.kv.release(pinned)
