"""Does the router predict a cache hit for a long text prompt sent again with a new question?

`python -m benchmarks text-routing`; what it runs and why: `docs/benchmarks/text-routing.md`.
Modules: `documents` (the texts), `cells` (one document's requests through one route),
`__main__` (the run and its page).
"""
