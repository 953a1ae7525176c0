"""The sim's admission of LoRA requests, as SGLang's scheduler admits them."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest

from connector.worker.admission import Admission
from connector.worker.lora import LoRARef, LoRARegistry
from connector.worker.sequence import SamplingParams, Sequence
from shared.tokenizer import ChatTokenizer
from tests.connector.test_retraction import PAGE, ids, sim_kv


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(model_dir)


def lora_seq(rid: str, ref: LoRARef, seed: int) -> Sequence:
    seq = Sequence(rid, ids(seed, 2 * PAGE), SamplingParams(max_new_tokens=4))
    seq.lora = ref
    return seq


def test_a_request_waiting_for_an_adapter_slot_does_not_hold_up_the_queue(
    tokenizer: ChatTokenizer,
) -> None:
    """One slot, held by a running request's adapter: a request for another adapter waits,
    and the one behind it for the loaded adapter starts (SGLang skips the first, it does not
    stop at it: a wait for a slot held by a whole decode would stall every request there)."""
    hot, cold = LoRARef("hot", "/a/hot"), LoRARef("cold", "/a/cold")
    registry = LoRARegistry([hot, cold], max_loaded=1, max_per_batch=1)
    admission = Admission(sim_kv(tokenizer, pages=64), 8, 16384, True, lora=registry)
    running = lora_seq("running", hot, 1)
    assert registry.acquire(hot, set()) is False  # resident from the start: no load
    running.lora_held = True
    blocked, behind = lora_seq("blocked", cold, 2), lora_seq("behind", hot, 3)
    waiting = deque([blocked, behind])

    step = admission.admit(waiting, [running], None)

    assert step.new == [behind]
    assert list(waiting) == [blocked]  # still first in line, not loaded, not holding a slot
    assert not blocked.lora_held and registry.resident.keys() == {"hot"}
    # once the running request is done, the adapter it held is evicted for the one waiting
    registry.release(hot)
    registry.release(hot)
    step = admission.admit(waiting, [], None)
    assert step.new == [blocked] and blocked.lora_load_pending
    assert registry.resident.keys() == {"cold"} and not waiting
