"""MemPool's distributed side: moving KV blocks between instances (MemServe 4.3, 4.4)."""
