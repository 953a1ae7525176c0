"""Does the router predict a cache hit for a long text prompt sent again with a new question?

Run: ``python -m benchmarks.text_routing [--quick] [--policy P] [--tokenizer-dir DIR]
[--out DIR]``. Writes results.json and README.md (a Markdown table) to DIR, by default
benchmarks/results/text_routing/ (a subfolder of it for a quick run, another policy or
another tokenizer), overwriting what was there.

Issue 37's measurement: two sim workers (``python -m connector.worker --backend sim``) and
``python -m router --policy prompt_tree`` in front of them, on free loopback ports. For each
document (Chinese and Japanese prose, numbers, synthetic words, a JSON tool list, Python code,
English prose, text mixing emoji, CJK and ``key=value`` pairs) and each text route
(``/v1/completions`` with a string ``prompt``, ``/generate`` with ``text``), the same
document is sent three times, each time with a different question after it, one request at
a time. Each (document, route) starts cold: the workers' caches are flushed and a new router
process is started, so its prompt tree is empty and the first request cannot be a predicted
hit; the second and third can, if the router sees that the first's worker holds the document.

Per request: the worker's prompt tokens and reported cached tokens
(``usage.prompt_tokens_details.cached_tokens`` or ``meta_info.cached_tokens``), and from the
router's /metrics read before and after it: whether ``sgl_router_cache_hits_total`` grew (a
predicted hit), the decision's reason (``sgl_router_load_balancing_events_total``), the
worker that served it (``sgl_router_processed_requests_total``) and the cached tokens the
router predicted (``memserve_router_predicted_cached_tokens_total``).

Modules: `documents` (the texts: generated from a seed or read from the repository), `cells`
(the cluster and the requests), `report` (the files), `__main__` (the command line).
"""
