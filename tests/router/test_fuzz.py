"""Fuzzing the router over real HTTP: its own OpenAPI document drives schemathesis, and
hand-made hostile bodies follow. Nothing may answer 5xx, crash the router or hang it; every
refusal is a 4xx with the JSON error body. Bounded: a few hundred requests, seconds each."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from benchmarks.reliability.bad_inputs import HOSTILE
from tests.fuzzing import error_bodies_are_json
from tests.http_client import call
from tests.procs import running


@pytest.fixture(scope="module")
def router_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("fuzz")
    worker_args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    worker_args += ["--context-length", "2048"]  # absurd max_tokens end within 2K steps
    with running("connector.worker", worker_args, logs) as worker:
        router_args = ["--policy", "prompt-tree", "--worker-urls", worker.url]
        router_args += ["--max-payload-size", str(1 << 20), "--disable-retries"]
        with running("router", router_args, logs) as router:
            yield router.url


@pytest.fixture(scope="module")
def api(router_url: str) -> Any:
    return schemathesis.openapi.from_url(router_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api")


# Adding workers at random URLs or flushing caches is management, not input handling.
@(
    schema.exclude(method=["POST", "DELETE"], path_regex="^/workers")
    .exclude(path="/flush_cache")
    .parametrize()
)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_generated_request_gets_a_5xx(case: Any, router_url: str) -> None:
    # No 5xx and well-formed errors; not whether every schema-valid body is accepted (the
    # schema cannot say "exactly one of text and input_ids" or "shorter than the context").
    case.call_and_validate(
        base_url=router_url, timeout=30, checks=[not_a_server_error, error_bodies_are_json]
    )


@pytest.mark.parametrize(
    ("route", "body", "status", "says"),
    [(case.route, case.body, case.status, case.says) for case in HOSTILE],
    ids=[case.name for case in HOSTILE],
)
def test_hostile_bodies_are_4xx_with_a_reason(
    router_url: str, route: str, body: bytes, status: int, says: str
) -> None:
    got, answer = call(router_url + route, raw=body)
    assert got == status and says in answer["message"], answer


def test_oversized_bodies_are_413_and_the_router_keeps_serving(router_url: str) -> None:
    huge = json.dumps({"text": "x" * (2 << 20)}).encode()
    got, answer = call(router_url + "/generate", raw=huge)
    assert got == 413 and "max-payload-size" in answer["message"]
    assert call(router_url + "/health")[0] == 200


@pytest.mark.parametrize("max_tokens", [-1, -(10**12), 10**12])
def test_negative_or_absurd_max_tokens_end_cleanly(router_url: str, max_tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    got, answer = call(router_url + "/v1/chat/completions", raw=json.dumps(body).encode())
    assert got in (200, 400), answer
    if got == 400:
        assert "max_tokens" in answer["message"] or "max_new_tokens" in answer["message"]


def test_a_wrong_method_names_the_allowed_ones(router_url: str) -> None:
    req = urllib.request.Request(router_url + "/generate", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 405 and "POST" in info.value.headers["Allow"]
    assert json.loads(info.value.read())["code"] == 405


def test_the_document_describes_every_route_the_router_serves(router_url: str) -> None:
    doc = call(router_url + "/openapi.json")[1]
    for path in ("/generate", "/v1/chat/completions", "/v1/completions", "/workers/{url}"):
        assert path in doc["paths"]
    assert doc["openapi"].startswith("3.")
