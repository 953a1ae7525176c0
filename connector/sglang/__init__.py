"""MemPool inside real SGLang servers: a HiCache L3 storage backend (`--hicache-storage-backend
dynamic`) whose pages live in MemPool, with MemServe's decode-to-prefill writeback.

`backend.MemPoolStorage` is the class SGLang loads; this package's other modules each do one
job (version guard, config, key encoding, the pool's thread). Importing this package does not
import SGLang; importing `connector.sglang.backend` does.
"""
