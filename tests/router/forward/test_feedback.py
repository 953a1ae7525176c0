"""Learning from an answer records the next prefix where it changes something: an answer
that ends inside the prompt's last page adds nothing to a holding recorded at dispatch (and
with several router processes, each record is a message to every sibling)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from router.forward.feedback import Learner, Served
from router.forward.relay import Outcome
from router.metrics import RouterMetrics
from router.policies import RouteRequest
from router.trees import PromptTrees, Tier
from router.workers import BreakerConfig, WorkerRegistry, WorkerType

C = WorkerType.COLOCATED
URL = "http://127.0.0.1:9301"


class CountingTrees(PromptTrees):
    """PromptTrees that count their records (what a replicated tree would publish)."""

    def __init__(self) -> None:
        super().__init__(page_size=16)
        self.records = 0

    def recorded(self, type: WorkerType, url: str, tokens: Sequence[int], tier: Tier) -> None:
        self.records += 1


def learn(
    answer: Outcome, recorded_at: float | None, reported: int = 32, prompt_tokens: int = 40
) -> CountingTrees:
    """One colocated answer to a `prompt_tokens`-token prompt, recorded at dispatch at
    `recorded_at` (None: not recorded), the worker reporting `reported` cached tokens where
    32 were predicted."""
    registry = WorkerRegistry(BreakerConfig())
    worker = registry.add(URL)
    trees = CountingTrees()
    learner = Learner(trees, registry, RouterMetrics(registry, trees), None, True, lambda: True)
    prompt = RouteRequest(list(range(prompt_tokens)), "", None)
    if recorded_at is not None:
        trees.record(C, URL, prompt.tokens or [])
        prompt.recorded = [(C, URL, recorded_at)]
    trees.records = 0
    served = [Served(worker, C, 32, reported)]
    learner.learn("/generate", prompt, answer, served, [(C, worker)])
    return trees


def test_a_short_answer_to_a_prompt_recorded_at_dispatch_is_not_recorded_again() -> None:
    trees = learn(Outcome(status=200, output_text="Yes", completion_tokens=1), time.monotonic())
    assert trees.records == 0
    assert trees.match(C, list(range(40))).held == {URL: 32}


def test_an_answer_that_fills_a_page_is_recorded_as_the_next_prefix() -> None:
    ids = list(range(100, 120))
    answer = Outcome(status=200, output_ids=ids, completion_tokens=len(ids))
    trees = learn(answer, time.monotonic())
    assert trees.records == 1
    assert trees.match(C, list(range(40)) + ids).held == {URL: 48}


def test_a_short_answer_is_recorded_when_dispatch_did_not_record_the_prompt() -> None:
    trees = learn(Outcome(status=200, output_text="Yes", completion_tokens=1), None)
    assert trees.records == 1
    assert trees.match(C, list(range(40))).held == {URL: 32}


def test_a_worker_that_reported_less_than_predicted_gets_its_path_back() -> None:
    """Feedback drops what it lacked; having computed the prompt it holds it all now."""
    answer = Outcome(status=200, output_text="Yes", completion_tokens=1)
    trees = learn(answer, time.monotonic(), reported=0)
    assert trees.records == 1
    assert trees.match(C, list(range(40))).held == {URL: 32}


def test_a_record_from_long_ago_is_refreshed() -> None:
    """A request that ran for over half the TTL: its dispatch record is renewed."""
    long_ago = time.monotonic() - PromptTrees().ttl_s
    trees = learn(Outcome(status=200, output_text="Yes", completion_tokens=1), long_ago)
    assert trees.records == 1


def test_a_tenant_is_charged_in_the_end_what_the_worker_computed() -> None:
    """Fair admission charges a request at its decision (what the worker is expected to
    compute) and then, whatever the decision expected (a pull the worker did not make, a
    prefix it had evicted), the prompt less the cached tokens the worker reported; a retry
    elsewhere charges only the difference."""
    charges: list[float] = []
    registry = WorkerRegistry(BreakerConfig())
    worker = registry.add(URL)
    trees = CountingTrees()
    learner = Learner(trees, registry, RouterMetrics(registry, trees), None, True, lambda: True)
    prompt = RouteRequest(list(range(4_000)), "", None, charge=charges.append)
    prompt.charge_computed(100)  # a pull of 3,900 tokens planned
    prompt.charge_computed(4_000)  # retried on a worker holding nothing
    prompt.charge_computed(100)  # and on one expected to pull again
    answer = Outcome(status=200, output_text="Yes", completion_tokens=1)
    served = [Served(worker, C, 3_900, 0)]  # it pulled nothing: it computed every token
    learner.learn("/generate", prompt, answer, served, [(C, worker)])
    assert charges == [100, 3_900, -3_900, 3_900]
    assert sum(charges) == 4_000 and prompt.charged == 4_000
