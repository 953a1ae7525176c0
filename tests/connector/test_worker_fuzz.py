"""Fuzzing the worker over real HTTP: its own OpenAPI document drives schemathesis, and
hand-made hostile bodies follow. A worker is what a router (ours or sglang-router) talks to;
nothing may answer 5xx, crash it or hang it. Bounded: a few hundred requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from benchmarks.reliability.bad_inputs import CASES, BadInput
from tests.fuzzing import error_bodies_are_json
from tests.http_client import call
from tests.procs import running

CONTEXT = 2048


@pytest.fixture(scope="module")
def worker_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    args += ["--context-length", str(CONTEXT)]  # absurd max_new_tokens end within 2K steps
    with running("connector.worker", args, tmp_path_factory.mktemp("fuzz")) as worker:
        yield worker.url


@pytest.fixture(scope="module")
def api(worker_url: str) -> Any:
    return schemathesis.openapi.from_url(worker_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx(case: Any, worker_url: str) -> None:
    case.call_and_validate(
        base_url=worker_url, timeout=30, checks=[not_a_server_error, error_bodies_are_json]
    )


@pytest.mark.parametrize(
    "case", [c for c in CASES if not c.router_only], ids=lambda c: c.name.replace(" ", "_")
)
def test_the_shared_bad_inputs(worker_url: str, case: BadInput) -> None:
    """The reliability table's bad inputs (benchmarks/reliability/bad_inputs.py)."""
    got, answer = call(worker_url + case.route, raw=case.body)
    if case.worker is None:
        assert 400 <= got < 500 and isinstance(answer["message"], str), (got, answer)
    else:
        assert got == case.worker, (got, answer)
    assert call(worker_url + "/health")[0] == 200


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("/generate", b'{"text": "a", "input_ids": [1]}', "input_ids"),
        ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}', "max_new"),
        ("/generate", b'{"text": "a", "sampling_params": {"temperature": "hot"}}', "temperature"),
        ("/detokenize", b'{"tokens": [1, "a"]}', "tokens"),
        ("/tokenize", b'{"prompt": ["a"]}', "prompt"),
    ],
)
def test_hostile_bodies_are_4xx_with_a_reason(
    worker_url: str, route: str, body: bytes, says: str
) -> None:
    got, answer = call(worker_url + route, raw=body)
    assert 400 <= got < 500 and says in answer["message"], (got, answer)


def test_a_prompt_longer_than_the_context_is_refused_and_the_worker_serves_on(
    worker_url: str,
) -> None:
    """SGLang refuses input + max_new_tokens beyond the context with a 400."""
    got, answer = call(worker_url + "/generate", {"input_ids": [5] * 4096})
    assert got == 400 and "context" in answer["message"].lower(), answer
    absurd = {"text": "hi", "sampling_params": {"max_new_tokens": 10**12}}
    ok, _ = call(worker_url + "/generate", absurd)
    assert ok in (200, 400)
    assert call(worker_url + "/health")[0] == 200


def test_out_of_vocabulary_ids_are_refused(worker_url: str) -> None:
    got, answer = call(worker_url + "/generate", {"input_ids": [10**9]})
    assert got == 400 and "vocab" in answer["message"].lower(), answer
    got, answer = call(worker_url + "/detokenize", {"tokens": [10**9]})
    assert got == 400 and "vocab" in answer["message"].lower(), answer


def test_the_document_describes_every_route_the_worker_serves(worker_url: str) -> None:
    doc = call(worker_url + "/openapi.json")[1]
    for path in ("/generate", "/v1/chat/completions", "/tokenize", "/flush_cache"):
        assert path in doc["paths"]
    assert doc["info"]["title"] == "memserve-worker"
