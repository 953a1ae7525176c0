"""Tenants (issue 38): the router mints each tenant's cache namespace, so no tenant reads
another's cached prefix whatever it sends, public prefixes are shared, keys rotate without a
restart, and a tenant's requests in flight are bounded.

The end-to-end tests run a real router in front of a real sim worker over loopback; each
fails without the feature (a client's salt passed through, or none set, would report the
other tenant's cached tokens where these expect none).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.admission import Refused
from router.request import CHAT, COMPLETIONS, GENERATE, RequestError
from router.tenants import Tenants, TenantsError, hash_key, parse
from router.tenants.__main__ import main
from shared.tokenizer import ChatTokenizer
from tests.procs import ROOT, Server, run_module, running
from tests.tokenizer_families import DEEPSEEK, shared_start, tokenizer_dir

PAGE = 16
SECRET = "test-tenant-secret-0b7d"
KEYS = {"a": "sk-alpha-1111", "b": "sk-bravo-2222", "c": "sk-charlie-3333", "d": "sk-delta-4444"}
OPERATOR_KEY = "sk-operator-9999"
SYSTEM = (
    "You are the shared support assistant of the Example gateway. You answer questions about "
    "orders, invoices and shipping, in short sentences, and never invent an order number. "
    "Tools: lookup_order(id), list_invoices(customer), track(parcel)."
)
TEXT_PREFIX = (
    "Shared instructions for every tenant: read the document below, then answer the question "
    "after it in one line, quoting the sentence that supports the answer. Document:\n"
)


def tenants_file(path: Path, keys: dict[str, str] | None = None, **extra: Any) -> Path:
    keys = keys or KEYS
    doc = {
        "tenants": [
            {"id": "a", "keys": [hash_key(keys["a"])]},
            {"id": "b", "keys": [hash_key(keys["b"])], "max_in_flight": 1},
            {"id": "c", "keys": [hash_key(keys["c"])], "own_salt": True},
            {"id": "d", "keys": [hash_key(keys["d"])], "tokens_per_s": 50},
        ],
        "public_prefixes": [SYSTEM, TEXT_PREFIX],
        **extra,
    }
    path.write_text(json.dumps(doc))
    return path


def minted(tenant: str) -> str:
    return hmac.new(SECRET.encode(), b"tenant:" + tenant.encode(), hashlib.sha256).hexdigest()


# ----------------------------------------------------------------- units


def test_hash_key_and_the_cli(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    assert hash_key("k") == "sha256:" + hashlib.sha256(b"k").hexdigest()
    monkeypatch.setattr(sys, "stdin", io.StringIO("sk-secret\n"))
    assert main(["hash-key"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("sk-secret")
    assert main(["new-key"]) == 0
    out = capsys.readouterr().out.split()
    assert out[3] == hash_key(out[1])
    assert main([]) == 2


def test_the_file_parses_as_json_and_toml() -> None:
    ka, kb = hash_key("ka"), hash_key("kb")
    from_json = parse(
        json.dumps(
            {
                "tenants": [
                    {"id": "a", "keys": [ka], "max_in_flight": 4, "tokens_per_s": 1000},
                    {"id": "b", "keys": kb, "own_salt": True},
                ],
                "public_prefixes": [
                    "hello",
                    {"sha256": "0" * 64},
                    {"sha256": "1" * 64, "chars": 9},
                ],
            }
        )
    )
    from_toml = parse(
        f"""
public_prefixes = ["hello", {{ sha256 = "{"0" * 64}" }}, {{ sha256 = "{"1" * 64}", chars = 9 }}]

[tenants.a]
keys = ["{ka}"]
max_in_flight = 4
tokens_per_s = 1000

[tenants.b]
keys = ["{kb}"]
own_salt = true
"""
    )
    for f in (from_json, from_toml):
        a, b = f.tenants["a"], f.tenants["b"]
        assert (a.max_in_flight, a.own_salt, a.tokens_per_s) == (4, False, 1000.0)
        assert b.own_salt and b.max_in_flight == 0
        assert f.by_key[hashlib.sha256(b"ka").digest()] is a
        assert [p.chars for p in f.public] == [5, None, 9]
        assert f.public[0].sha256 == hashlib.sha256(b"hello").hexdigest()


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ("{not json", "not valid JSON or TOML"),
        ('{"tenants": []}', "non-empty list"),
        ('{"tenants": [{"id": "a", "keys": ["sk-plain-key"]}]}', "stored hashed"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"]}, {"id": "a", "keys": ["KEY"]}]}', "twice"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"]}, {"id": "b", "keys": ["KEY"]}]}', "share a"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"], "own_salt": "yes"}]}', "own_salt"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"], "max_in_flight": -1}]}', "max_in_flight"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"], "colour": 1}]}', "unknown keys"),
        ('{"tenants": [{"id": "", "keys": ["KEY"]}]}', "'id'"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"]}], "public_prefixes": [{"sha256": "x"}]}', "64"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"]}], "extra": 1}', "unknown top-level"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"], "share": -1}]}', "must be a number > 0"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"], "share": 0}]}', "must be a number > 0"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"], "share": "2"}]}', "'share' must be a number"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"], "max_tree_pages": 2.5}]}', "whole number"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"], "max_tree_pages": 0}]}', "pages >= 1"),
        ('{"tenants": [{"id": "a", "keys": ["KEY"]}], "tree_pages_per_tenant": -3}', "pages >= 0"),
    ],
)
def test_a_bad_file_says_what_is_wrong(doc: str, needle: str) -> None:
    with pytest.raises(TenantsError, match=needle) as err:
        parse(doc.replace("KEY", hash_key("k")))
    assert "sk-plain-key" not in str(err.value)  # a key put in by mistake is never echoed


def units(tmp_path: Path, **kw: Any) -> Tenants:
    doc = {
        "tenants": [
            {"id": "a", "keys": [hash_key("ka")], "max_in_flight": 2},
            {"id": "c", "keys": [hash_key("kc")], "own_salt": True},
        ]
    }
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(doc))
    return Tenants(path, SECRET.encode(), **kw)


def test_the_namespace_fields_are_minted_from_the_tenant(tmp_path: Path) -> None:
    t = units(tmp_path, operator_key="op")
    a, c = t.identify("Bearer ka"), t.identify("Bearer kc")
    assert a is not None and c is not None and a.id == "a"
    assert t.identify("Bearer kb") is None and t.identify("ka") is None
    assert t.identify(None) is None and t.identify("Bearer ") is None
    assert t.identify("Bearer op") is t.operator
    body: dict[str, Any] = {"text": "hi", "cache_salt": "victim", "shared_prefix_tokens": 999}
    sent = msgspec.json.decode(t.namespace(a, GENERATE, body, b"{}"))
    assert sent == {"text": "hi", "cache_salt": minted("a")}  # the client's salt replaced
    body = {"text": "hi", "cache_salt": "mine", "extra_key": "k1"}
    sent = msgspec.json.decode(t.namespace(c, GENERATE, body, b"{}"))
    assert sent["cache_salt"] == f"{minted('c')}:mine"  # its own, under the tenant's
    assert sent["extra_key"] == f"{minted('c')}:k1"
    # nothing to replace: the fields are appended to the client's bytes
    raw = b'{"text": "hi" , "stream":false}  \n'
    sent = msgspec.json.decode(t.namespace(a, GENERATE, msgspec.json.decode(raw), raw))
    assert sent == {"text": "hi", "stream": False, "cache_salt": minted("a")}
    for bad in ({"cache_salt": 5}, {"extra_key": ["k"]}):
        with pytest.raises(RequestError) as err:
            t.namespace(a, GENERATE, {"text": "hi", **bad}, b"{}")
        assert err.value.status == 400
    assert msgspec.json.decode(t.namespace(a, GENERATE, {}, b" {} ")) == {"cache_salt": minted("a")}


def test_max_in_flight_refuses_and_is_shared_among_processes(tmp_path: Path) -> None:
    t = units(tmp_path)
    a = t.enter("Bearer ka")
    t.enter("Bearer ka")
    with pytest.raises(Refused) as refused:
        t.enter("Bearer ka")
    assert refused.value.retry_after_s >= 1
    t.exit(a)
    t.exit(t.enter("Bearer ka"))
    t.enter("Bearer kc")  # another tenant is not held back
    with pytest.raises(RequestError) as err:
        t.enter("Bearer nobody")
    assert err.value.status == 401
    assert units(tmp_path, process=(0, 3)).limit(a) == 1  # 2 over 3 processes: 1, 1, 1
    assert units(tmp_path, process=(2, 3)).limit(a) == 1


def test_reload_on_change_keeps_the_old_file_when_the_new_one_is_bad(tmp_path: Path) -> None:
    now = [0.0]
    t = units(tmp_path, clock=lambda: now[0])
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"id": "a", "keys": [hash_key("ka2")]}]}))
    t.maybe_reload()  # looked at at most once a second
    assert t.identify("Bearer ka") is not None
    now[0] = 1.5
    t.maybe_reload()
    assert t.identify("Bearer ka") is None and t.identify("Bearer ka2") is not None
    path.write_text('{"tenants": [{"id": "a", "keys": ["sk-plain"]}]}')
    now[0] = 3.0
    t.maybe_reload()
    assert t.identify("Bearer ka2") is not None and t.reload_errors == 1


def test_shares_load_with_defaults_and_a_bad_one_is_not_reloaded(tmp_path: Path) -> None:
    now = [0.0]
    t = units(tmp_path, clock=lambda: now[0])
    assert (t.tree_pages("a", 1000), t.tree_pages("", 1000)) == (500, 0)  # split; the operator
    assert t.share("a") == 1.0
    path = tmp_path / "tenants.json"
    doc = {
        "tenants": [
            {"id": "a", "keys": [hash_key("ka")], "share": 3, "max_tree_pages": 64},
            {"id": "c", "keys": [hash_key("kc")]},
        ],
        "tree_pages_per_tenant": 200,
    }
    path.write_text(json.dumps(doc))
    now[0] = 1.5
    t.maybe_reload()
    assert (t.share("a"), t.tree_pages("a", 1000), t.tree_pages("c", 1000)) == (3.0, 64, 200)
    doc["tenants"][0]["share"] = -1  # type: ignore[index]
    path.write_text(json.dumps(doc))
    now[0] = 3.0
    t.maybe_reload()
    assert t.reload_errors == 1 and t.share("a") == 3.0  # the loaded shares stay


# ----------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def worker(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    args += ["--max-total-tokens", "65536", "--context-length", "4096"]
    with running("connector.worker", args, tmp_path_factory.mktemp("worker")) as server:
        yield server


@pytest.fixture(scope="module")
def keyfile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tenants_file(tmp_path_factory.mktemp("tenants") / "tenants.json")


@pytest.fixture(scope="module")
def router(worker: Server, keyfile: Path) -> Iterator[Server]:
    args = ["--worker-urls", worker.url, "--tenants", str(keyfile)]
    args += ["--tenant-secret", SECRET, "--api-key", OPERATOR_KEY]
    with running("router", args, keyfile.parent) as server:
        yield server


def post(url: str, body: Any, key: str | None) -> tuple[int, Any, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null"), err.headers


def cached(url: str, route: str, body: dict[str, Any], key: str | None) -> int:
    status, answer, _ = post(url + route, {**body, **limits(route)}, key)
    assert status == 200, answer
    if route == GENERATE:
        return int(answer["meta_info"]["cached_tokens"])
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def limits(route: str) -> dict[str, Any]:
    return {"sampling_params": {"max_new_tokens": 2}} if route == GENERATE else {"max_tokens": 2}


def words(seed: int, n: int = 60) -> str:
    """A private text of some 100+ tokens, different per seed."""
    return " ".join(f"w{(seed * 7919 + i * 104729) % 9973}" for i in range(n))


def ids(seed: int, n: int = 96) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 100 for i in range(n)]


def chat(seed: int) -> list[dict[str, str]]:
    """A chat that differs from its first page on (a template's default system prompt, the
    same in every chat without one, would be cached once per tenant and hit)."""
    return [
        {"role": "system", "content": f"Session {seed}: " + words(seed, 8)},
        {"role": "user", "content": words(seed + 1)},
    ]


# every inference route, both prompt forms
PROMPTS: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "generate-text": (GENERATE, lambda s: {"text": words(s)}),
    "generate-ids": (GENERATE, lambda s: {"input_ids": ids(s)}),
    "completions-text": (COMPLETIONS, lambda s: {"prompt": words(s)}),
    "completions-ids": (COMPLETIONS, lambda s: {"prompt": ids(s)}),
    "chat": (CHAT, lambda s: {"messages": chat(s)}),
}


@pytest.mark.parametrize("form", sorted(PROMPTS))
def test_a_tenant_never_reads_another_tenants_prompt(router: Server, form: str) -> None:
    route, make = PROMPTS[form]
    body = make(100 + sorted(PROMPTS).index(form))
    assert cached(router.url, route, body, KEYS["b"]) == 0
    assert cached(router.url, route, body, KEYS["a"]) == 0  # B's identical prompt: not A's
    assert cached(router.url, route, body, KEYS["a"]) >= 4 * PAGE  # A's own: a hit
    assert cached(router.url, route, body, KEYS["c"]) == 0


@pytest.mark.parametrize("form", ["generate-text", "chat"])
def test_a_copied_salt_gets_no_hit(router: Server, worker: Server, form: str) -> None:
    route, make = PROMPTS[form]
    body = make(200 + len(form))
    assert cached(router.url, route, body, KEYS["a"]) == 0
    # the salt A's requests carry does hit on the worker itself (the test's HMAC is right)
    assert cached(worker.url, route, {**body, "cache_salt": minted("a")}, None) > 0
    victim = {**body, "cache_salt": minted("a")}
    assert cached(router.url, route, victim, KEYS["b"]) == 0  # replaced by B's
    assert cached(router.url, route, victim, KEYS["c"]) == 0  # own_salt: under C's
    assert cached(router.url, route, victim, KEYS["b"]) > 0  # B's own namespace, the second time


def test_own_salt_hits_only_its_own_salt(router: Server) -> None:
    body = {"text": words(300)}
    c = KEYS["c"]
    assert cached(router.url, GENERATE, {**body, "cache_salt": "x"}, c) == 0
    assert cached(router.url, GENERATE, {**body, "cache_salt": "x"}, c) > 0
    assert cached(router.url, GENERATE, {**body, "cache_salt": "y"}, c) == 0
    assert cached(router.url, GENERATE, body, c) == 0  # the tenant's salt alone: apart
    assert cached(router.url, GENERATE, {**body, "cache_salt": "x"}, KEYS["a"]) == 0


def test_a_public_system_prompt_is_shared_and_the_rest_is_not(
    router: Server, model_dir: Path
) -> None:
    tok = ChatTokenizer(model_dir)
    public = len(
        tok.encode_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    )
    assert public >= 2 * PAGE
    chat = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": words(400)},
        ]
    }
    assert cached(router.url, CHAT, chat, KEYS["a"]) == 0
    assert cached(router.url, CHAT, chat, KEYS["b"]) == public // PAGE * PAGE  # public part only
    assert cached(router.url, CHAT, chat, KEYS["b"]) > public // PAGE * PAGE + PAGE  # B's own
    # a system message that is not public is never shared
    other = {"messages": [{"role": "system", "content": SYSTEM + " "}, chat["messages"][1]]}
    assert cached(router.url, CHAT, other, KEYS["a"]) == 0
    assert cached(router.url, CHAT, other, KEYS["b"]) == 0


@pytest.mark.parametrize("route", [GENERATE, COMPLETIONS])
def test_a_public_text_prefix_is_shared_and_the_rest_is_not(
    router: Server, model_dir: Path, route: str
) -> None:
    tok = ChatTokenizer(model_dir)
    prompt = TEXT_PREFIX + words(500 + len(route))
    full, alone = tok.encode(prompt), tok.encode(TEXT_PREFIX)
    common = (
        next(i for i, (x, y) in enumerate(zip(full, alone, strict=False)) if x != y)
        if any(x != y for x, y in zip(full, alone, strict=False))
        else len(alone)
    )
    body = {"text": prompt} if route == GENERATE else {"prompt": prompt}
    first = cached(router.url, route, body, KEYS["a"])  # the other route's test cached it
    shared = cached(router.url, route, body, KEYS["b"])
    assert shared % PAGE == 0 and common - 2 * PAGE < shared <= common
    assert first in (0, shared)
    # the same tokens as ids are shared as well
    id_body = {"input_ids": full} if route == GENERATE else {"prompt": full}
    assert cached(router.url, route, id_body, KEYS["c"]) == shared


def test_keys_guard_the_routes(router: Server) -> None:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
    for key in (None, "", "sk-nobody", KEYS["a"] + "x", hash_key(KEYS["a"])):
        status, answer, _ = post(router.url + GENERATE, body, key)
        assert status == 401 and answer["code"] == 401, key
    assert post(router.url + GENERATE, body, OPERATOR_KEY)[0] == 200
    for path, tenant_may in (
        ("/v1/models", True),
        ("/workers", False),
        ("/get_server_info", False),
    ):
        req = urllib.request.Request(
            router.url + path, headers={"Authorization": f"Bearer {KEYS['a']}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status = resp.status
        except urllib.error.HTTPError as err:
            status = err.code
        assert (status == 200) == tenant_may, path


def test_tokens_per_s_is_a_429_with_retry_after(router: Server) -> None:
    body = {"input_ids": ids(7, 200), "sampling_params": {"max_new_tokens": 1}}
    assert post(router.url + GENERATE, body, KEYS["d"])[0] == 200  # a full bucket: it goes
    status, answer, headers = post(router.url + GENERATE, body, KEYS["d"])
    assert status == 429 and answer["code"] == 429, answer
    assert int(headers["Retry-After"]) >= 3  # about 150 tokens of debt at 50 a second
    assert post(router.url + GENERATE, body, KEYS["a"])[0] == 200  # others go on
    req = urllib.request.Request(
        router.url + "/get_server_info", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        info = json.loads(resp.read())["tenants"]
    assert info["tenants"] == 4 and info["refusals"]["d"] >= 1
    assert SECRET not in json.dumps(info) and minted("a") not in json.dumps(info)
    req = urllib.request.Request(
        router.url + "/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    refused = 'memserve_router_tenant_refusals_total{reason="tenant_tokens_per_s",tenant="d"}'
    assert any(line.startswith(refused) for line in text.splitlines()), text[-2000:]
    # per tenant: its requests, and the tokens that make its hit ratio (no key, no salt)
    assert 'memserve_router_group_requests_total{adapter="none",tenant="a"}' in text
    assert 'memserve_router_group_cached_tokens_total{adapter="none",tenant="a"}' in text
    assert minted("a") not in text and KEYS["a"] not in text


def test_max_in_flight_is_a_429_with_retry_after(model_dir: Path, tmp_path: Path) -> None:
    args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "1"]
    path = tenants_file(tmp_path / "tenants.json")
    with (
        running("connector.worker", args, tmp_path) as worker,
        running("router", ["--worker-urls", worker.url, "--tenants", str(path)], tmp_path) as r,
    ):
        slow = {"text": "hello", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        first: list[int] = []
        thread = threading.Thread(
            target=lambda: first.append(post(r.url + GENERATE, slow, KEYS["b"])[0])
        )
        thread.start()
        time.sleep(0.5)  # in flight first (a probe sent before it would refuse it instead)
        deadline = time.monotonic() + 10
        quick = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        status: int = 200
        answer: Any = None
        headers: Any = None
        while time.monotonic() < deadline and thread.is_alive():
            status, answer, headers = post(r.url + GENERATE, quick, KEYS["b"])
            if status == 429:
                break
            time.sleep(0.05)
        assert status == 429 and answer is not None and headers is not None, (answer, first)
        assert answer["code"] == 429 and int(headers["Retry-After"]) >= 1
        assert post(r.url + GENERATE, quick, KEYS["a"])[0] == 200  # another tenant goes on
        thread.join(60)
        assert first == [200]
        assert post(r.url + GENERATE, quick, KEYS["b"])[0] == 200  # its slot is back


def same_stamp(path: Path, rewrite: Callable[[], object]) -> None:
    """Rewrite the file in place keeping its size and times: only SIGHUP can tell."""
    before = path.stat()
    rewrite()
    assert path.stat().st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_keys_rotate_without_a_restart(worker: Server, tmp_path: Path) -> None:
    path = tenants_file(tmp_path / "tenants.toml")
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    rotated = {**KEYS, "a": "sk-alpha-rotated"}
    with running("router", ["--worker-urls", worker.url, "--tenants", str(path)], tmp_path) as r:
        assert post(r.url + GENERATE, body, KEYS["a"])[0] == 200
        tenants_file(path, rotated)  # rewritten in place: its modification time changes
        deadline = time.monotonic() + 10
        while post(r.url + GENERATE, body, KEYS["a"])[0] != 401:
            assert time.monotonic() < deadline, "the old key still works"
            time.sleep(0.2)
        assert post(r.url + GENERATE, body, rotated["a"])[0] == 200
        assert post(r.url + GENERATE, body, KEYS["b"])[0] == 200  # the others' keys stay
        # a bad file is logged and the tenants stay as they were, on a change and on SIGHUP
        path.write_text('{"tenants": [{"id": "a", "keys": ["sk-pasted-by-mistake"]}]}')
        time.sleep(1.5)
        r.proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        assert post(r.url + GENERATE, body, rotated["a"])[0] == 200
        tenants_file(path, {**rotated, "b": "sk-bravo-rotated"})  # (SIGHUP alone: below)
        r.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while post(r.url + GENERATE, body, "sk-bravo-rotated")[0] != 200:
            assert time.monotonic() < deadline, "not reloaded"
            time.sleep(0.1)
        assert r.proc.poll() is None
    log = r.log.read_text() if r.log else ""
    assert "tenants file not reloaded" in log
    assert "sk-pasted-by-mistake" not in log and KEYS["a"] not in log


def test_two_replicas_with_one_secret_keep_tenants_apart_and_share_their_hits(
    worker: Server, tmp_path: Path, redis_url: str
) -> None:
    """Router replicas (--redis-url) with the same secret: a tenant's prompt hits through
    the other replica, another tenant's identical prompt does not, through either."""
    path = tenants_file(tmp_path / "tenants.json")
    args = ["--worker-urls", worker.url, "--tenants", str(path), "--redis-url", redis_url]
    env_secret = ["--tenant-secret", SECRET]
    with (
        running("router", [*args, *env_secret, "--replica-id", "r1"], tmp_path) as r1,
        running("router", [*args, *env_secret, "--replica-id", "r2"], tmp_path) as r2,
    ):
        for route, make in (PROMPTS["generate-text"], PROMPTS["chat"]):
            body = make(1000 + len(route))
            assert cached(r1.url, route, body, KEYS["a"]) == 0
            assert cached(r2.url, route, body, KEYS["b"]) == 0
            assert cached(r1.url, route, body, KEYS["b"]) >= 4 * PAGE  # B's, through r2
            assert cached(r2.url, route, body, KEYS["a"]) >= 4 * PAGE  # A's, through r1
            copied = {**body, "cache_salt": minted("a")}
            assert cached(r2.url, route, copied, KEYS["c"]) == 0


def test_processes_mint_one_salt_and_pass_sighup_on(worker: Server, tmp_path: Path) -> None:
    """--processes 2 without a secret: the supervisor draws one for both processes (else a
    tenant's prompt would hit only on the process that first served it); SIGHUP to the
    supervisor reaches them and kills nothing."""
    path = tenants_file(tmp_path / "tenants.json")
    args = ["--worker-urls", worker.url, "--tenants", str(path), "--processes", "2"]
    body = {"text": words(900), "sampling_params": {"max_new_tokens": 1}}
    with running("router", args, tmp_path) as r:
        assert post(r.url + GENERATE, body, KEYS["a"])[0] == 200
        hits: dict[str, int] = {}
        for _ in range(200):
            status, answer, headers = post(r.url + GENERATE, body, KEYS["a"])
            assert status == 200, answer
            hits.setdefault(headers["X-Router-Process"], answer["meta_info"]["cached_tokens"])
            if len(hits) == 2:
                break
        assert len(hits) == 2 and all(n >= 4 * PAGE for n in hits.values()), hits
        same_stamp(path, lambda: tenants_file(path, {**KEYS, "a": "sk-alpha-hup"}))
        r.proc.send_signal(signal.SIGHUP)
        answered: set[str] = set()
        deadline = time.monotonic() + 10
        while len(answered) < 2:
            assert time.monotonic() < deadline, answered
            status, _, headers = post(r.url + GENERATE, body, "sk-alpha-hup")
            if status == 200:
                answered.add(headers["X-Router-Process"])
        assert r.proc.poll() is None


@pytest.mark.parametrize(
    "content",
    [
        '{"tenants": [{"id": "a", "keys": ["sk-in-clear"]}]}',
        "[tenants.a\nkeys = 1",
        None,
        f'{{"tenants": [{{"id": "a", "keys": ["{hash_key("k")}"], "share": -0.5}}]}}',
    ],
)
def test_a_bad_tenants_file_is_a_clear_startup_error(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "tenants.json"
    if content is not None:
        path.write_text(content)
    run = run_module("router", ["--worker-urls", "http://127.0.0.1:9", "--tenants", str(path)])
    assert run.returncode != 0
    assert run.stderr.strip().startswith("--tenants:"), run.stderr
    assert "Traceback" not in run.stderr and "sk-in-clear" not in run.stderr


def test_the_docs_example_parses() -> None:
    page = (ROOT / "docs" / "router" / "tenants.md").read_text()
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    loaded = parse(example, "docs/router/tenants.md")
    assert set(loaded.tenants) == {"acme", "globex"}
    assert loaded.tenants["globex"].own_salt and len(loaded.tenants["globex"].key_hashes) == 2
    assert loaded.by_key[hashlib.sha256(b"sk-acme-example").digest()].id == "acme"
    assert len(loaded.public) == 2


def test_tokens_per_s_refuses_while_the_bucket_is_in_debt(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "tenants.json"
    doc = {"tenants": [{"id": "d", "keys": [hash_key("kd")], "tokens_per_s": 100}]}
    path.write_text(json.dumps(doc))
    t = Tenants(path, SECRET.encode(), clock=lambda: now[0], process=(0, 2))  # 50 a process
    d = t.identify("Bearer kd")
    assert d is not None
    big = {"input_ids": list(range(120)), "sampling_params": {"max_new_tokens": 30}}
    t.namespace(d, GENERATE, dict(big), b"{}")  # a full bucket lets one large request go
    with pytest.raises(Refused) as refused:
        t.namespace(d, GENERATE, {"text": "hi"}, b"{}")
    assert refused.value.retry_after_s == 2  # 100 tokens of debt at 50 a second
    now[0] = 2.01
    t.namespace(d, CHAT, {"messages": [{"role": "user", "content": "x" * 40}]}, b"{}")
    assert t.request_tokens(CHAT, {"messages": [{"role": "user", "content": "x" * 40}]}) == 10
    assert t.request_tokens(COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 5}) == 8
    assert t.info()["refusals"] == {"d": 1}


# ----------------------------------------------------------------- two models

# A public text whose token counts differ by model: 341 of the tiny model's tokens, 151 of
# DeepSeek's (CJK runs are one piece there).
CJK_PREFIX = (
    "共享说明：请阅读下面的文件，然后用一句话回答问题，并引用支持答案的句子。" * 4  # noqa: RUF001
    + " Shared instructions 2026-11-29: read the document, answer in one line. 1234567890 " * 3
)


@pytest.fixture(scope="module")
def two_models(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A router with tenants in front of two models of different tokenizer families."""
    root = tmp_path_factory.mktemp("two-models")
    other_dir = tokenizer_dir(DEEPSEEK, root / "tokenizers", model_dir)
    keys = tenants_file(root / "tenants.json", public_prefixes=[CJK_PREFIX])

    def worker(path: Path, name: str) -> list[str]:
        return [
            *("--backend", "sim", "--model-path", str(path), "--time-scale", "0"),
            *("--served-model-name", name, "--page-size", str(PAGE)),
        ]

    with (
        running("connector.worker", worker(model_dir, "alpha"), root) as alpha,
        running("connector.worker", worker(other_dir, "beta"), root) as beta,
    ):
        models = root / "models.toml"
        models.write_text(
            f'[[model]]\nname = "alpha"\ntokenizer_path = "{model_dir}"\n'
            f'worker_urls = ["{alpha.url}"]\n\n'
            f'[[model]]\nname = "beta"\ntokenizer_path = "{other_dir}"\n'
            f'worker_urls = ["{beta.url}"]\n'
        )
        args = ["--models", str(models), "--tenants", str(keys), "--tenant-secret", SECRET]
        args += ["--page-size", str(PAGE)]
        with running("router", args, root) as router:
            yield router.url


@pytest.mark.parametrize("route", [GENERATE, COMPLETIONS])
@pytest.mark.parametrize("model", ["alpha", "beta"])
def test_a_public_prefix_is_counted_in_its_models_tokens(
    two_models: str, model_dir: Path, tmp_path: Path, model: str, route: str
) -> None:
    """Each model's engine salts what follows the public text in its own tokens: counted in
    the default model's tokenizer (341 tokens against DeepSeek's 151 here), tenant B was
    reported 304-320 cached tokens on the DeepSeek model, some 160 of them tenant A's
    private text."""
    path = model_dir if model == "alpha" else tokenizer_dir(DEEPSEEK, tmp_path, model_dir)
    tok = ChatTokenizer(path)
    prompt = CJK_PREFIX + words(900 + len(route) + len(model))
    common = shared_start(tok.encode(prompt), tok.encode(CJK_PREFIX))
    assert common > 8 * PAGE
    field = "text" if route == GENERATE else "prompt"
    body = {field: prompt, "model": model}
    first = cached(two_models, route, body, KEYS["a"])  # the other route's test cached it
    shared = cached(two_models, route, body, KEYS["b"])
    assert shared % PAGE == 0 and common - 2 * PAGE < shared <= common, (shared, common)
    assert first in (0, shared)
    assert cached(two_models, route, body, KEYS["a"]) > common + PAGE  # its own, whole
