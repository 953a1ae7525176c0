"""The global scheduler: `python -m router` (issue: router). It reuses mempool.radix.RadixTree."""
