"""The backend driven through SGLang's own loader, page hashing and storage call paths, on
CPU tensors in one process (one server); test_writeback.py runs two servers."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage
from sglang.srt.mem_cache.storage import StorageBackendFactory

from connector.sglang import version
from connector.sglang.backend import MemPoolStorage
from connector.sglang.cpu_paths import Controller
from connector.sglang.keys import key_tokens
from tests.connector.sglang.helpers import (
    PAGE,
    create,
    extra,
    host_pool,
    indices,
    keys_of,
    page_digest,
    storage_config,
)


@pytest.fixture
def backend():
    be = create(extra(), host_pool(seed=1))
    yield be
    be.close()


def test_sglang_factory_loads_it_from_the_extra_config(backend: MemPoolStorage) -> None:
    assert isinstance(backend, HiCacheStorage)
    assert backend.sglang_version == "0.5.23"
    assert backend.stats()["tiers"]["host"]["blocks"] == 64


def test_page_keys_are_sglangs_sha256_chain() -> None:
    tokens = list(range(7, 7 + 3 * PAGE)) + [1, 2]  # a partial last page gets no key
    keys = keys_of(tokens)
    prior = b""
    for i, key in enumerate(keys):
        page = struct.pack(f"<{PAGE}I", *tokens[i * PAGE : (i + 1) * PAGE])
        prior = hashlib.sha256(prior + page).digest()
        assert key == prior.hex()
        assert key_tokens(key).tobytes() == prior  # MemPool's page is the digest itself
    assert len(keys) == 3


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1", "legacy"])
def test_backup_then_prefetch_returns_the_same_bytes(layout: str, zero_copy: bool) -> None:
    host = host_pool(layout=layout, seed=2)
    be = create(extra(), host)
    try:
        ctl = Controller(be, host, zero_copy=zero_copy)
        tokens = list(range(1000, 1000 + 6 * PAGE + 3))
        written = [page_digest(host, i * PAGE) for i in range(6)]
        assert ctl.backup(indices(6), keys_of(tokens)) == 6 * PAGE
        hit, pages = ctl.prefetch(tokens, indices(6, first_page=20))
        assert (hit, pages) == (6 * PAGE, 6)
        assert [page_digest(host, (20 + i) * PAGE) for i in range(6)] == written
    finally:
        be.close()


def test_stored_bytes_are_the_file_backends(backend: MemPoolStorage, tmp_path: Path) -> None:
    host = backend.mem_pool_host
    file_be = HiCacheFile(storage_config({"file_storage_path": str(tmp_path)}))
    file_be.register_mem_pool_host(host)
    keys = keys_of(list(range(50, 50 + 4 * PAGE)))
    assert Controller(file_be, host, zero_copy=False).backup(indices(4), keys) == 4 * PAGE
    assert Controller(backend, host).backup(indices(4), keys) == 4 * PAGE
    targets = [host.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys, targets)
    for key, page in zip(keys, got, strict=True):
        assert page is not None
        on_disk = next(tmp_path.glob(f"{key}*.bin")).read_bytes()
        assert page.view(torch.uint8).numpy().tobytes() == on_disk


def test_batch_exists_counts_leading_hits_only(backend: MemPoolStorage) -> None:
    host = backend.mem_pool_host
    tokens = list(range(300, 300 + 5 * PAGE))
    keys = keys_of(tokens)
    stored = [keys[0], keys[1], keys[3]]  # page 2 missing
    idx = torch.cat([indices(2), indices(1, first_page=3)])
    assert backend.batch_set_v1(stored, idx) == [True, True, True]
    assert backend.batch_exists(keys) == 2
    assert backend.exists(keys[3]) and not backend.exists(keys[2])
    hit, pages = Controller(backend, host).prefetch(tokens, indices(5, first_page=10))
    assert (hit, pages) == (2 * PAGE, 2)
    # A later turn's query after a local prefix: SGLang hashes from the last local page.
    hit, _ = Controller(backend, host).prefetch(tokens[3 * PAGE :], indices(2, 10), keys[2])
    assert hit == PAGE  # page 3 hits (its key names its whole prefix); 4 was never stored
    assert backend.batch_get_v1([keys[2], keys[3]], indices(2, 12)) == [False, True]


def test_a_full_pool_evicts_least_recently_used_pages() -> None:
    host = host_pool(seed=3)
    be = create(extra(mempool_capacity_pages=4), host)
    try:
        keys = keys_of(list(range(10, 10 + 6 * PAGE)))
        assert be.batch_set_v1(keys[:4], indices(4)) == [True] * 4
        assert be.exists(keys[0])  # touched: now the most recently used
        assert be.batch_set_v1(keys[4:], indices(2, 4)) == [True, True]
        assert [be.exists(k) for k in keys] == [True, False, False, True, True, True]
        assert be.stats()["tiers"]["host"]["free"] == 0
        be.clear()
        assert be.batch_exists(keys) == 0 and be.stats()["tiers"]["host"]["free"] == 4
    finally:
        be.close()


def test_setting_a_cached_page_again_keeps_one_copy(backend: MemPoolStorage) -> None:
    keys = keys_of(list(range(40, 40 + 2 * PAGE)))
    backend.batch_set_v1(keys, indices(2))
    backend.batch_set_v1(keys + keys, torch.cat([indices(2), indices(2)]))
    assert backend.stats()["tiers"]["host"]["used"] == 2


# ----------------------------------------------------------------- what users get wrong


def test_an_unsupported_sglang_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(version, "installed_version", lambda: "0.5.22")
    with pytest.raises(version.UnsupportedSGLangVersion, match=r"sglang 0\.5\.22 .*0\.5\.23"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra()), None)
    monkeypatch.setattr(version, "installed_version", lambda: None)
    with pytest.raises(version.UnsupportedSGLangVersion, match="not installed"):
        version.check_version()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mempool_instance_id": None}, "missing required key 'mempool_instance_id'"),
        ({"mempool_capacity_pages": None}, "missing required key 'mempool_capacity_pages'"),
        ({"mempool_capacity_pages": 0}, "mempool_capacity_pages must be positive"),
        ({"mempool_instance_id": "1"}, "mempool_instance_id must be an integer"),
        ({"mempool_instance_id": 70000}, r"1\.\.65535"),
        ({"mempool_writeback_peers": ["localhost:7000"]}, "bad peer 'localhost:7000'"),
        ({"mempool_writeback_peers": ["1@127.0.0.1:7000"]}, "names this instance"),
        ({"mempool_writeback_peer": ["2@h:1"]}, "unknown MemPool backend keys"),
        ({"mempool_timeout_s": -1}, "mempool_timeout_s must be a positive number"),
    ],
)
def test_bad_extra_config_says_what_is_wrong(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra(**overrides)), None)


def test_sglangs_own_keys_are_required_too() -> None:
    cfg = extra(module_path=None)
    with pytest.raises(ValueError, match="Missing required field 'module_path'"):
        StorageBackendFactory.create_backend("dynamic", storage_config(cfg), None)


def test_a_page_size_mismatch_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match=r"mempool_page_size=16 tokens.*pages of 4 tokens"):
        create(extra(mempool_page_size=16), host_pool())


def test_wrong_host_indices_and_tensors_are_refused(backend: MemPoolStorage) -> None:
    keys = keys_of(list(range(60, 60 + 2 * PAGE)))
    with pytest.raises(
        ValueError, match=r"2 keys need 8 host indices \(pages of 4 tokens\), got 7"
    ):
        backend.batch_set_v1(keys, indices(2)[:7])
    with pytest.raises(ValueError, match="host index 128 does not start a whole page"):
        backend.batch_get_v1(keys, indices(2, first_page=31))
    with pytest.raises(ValueError, match="page size mismatch: a page here is 768 bytes"):
        backend.batch_set(keys[:1], [torch.zeros(10, dtype=torch.float16)])
    assert backend.batch_exists(keys) == 0  # nothing half-stored
    assert backend.stats()["tiers"]["host"]["used"] == 0


def test_calls_before_the_host_pool_is_registered_say_so() -> None:
    be = StorageBackendFactory.create_backend("dynamic", storage_config(extra()), None)
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        be.batch_exists(["00" * 32])
