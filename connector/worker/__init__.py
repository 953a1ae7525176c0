"""SGLang-compatible CPU worker whose KV cache lives in MemPool: `python -m connector.worker`."""
