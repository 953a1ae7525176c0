"""Does the router predict a cache hit for a long text prompt sent again with a new question?

`python -m benchmarks text-routing`: per document (prose in several scripts, numbers, JSON,
code, emoji) and text route, the same document sent three times with a new question, cold
each time; the cached tokens the router predicted against those the worker reported.
docs/benchmarks/text-routing.md has the method and the figures.

Modules: `documents` (the texts: generated from a seed or read from the repository), `cells`
(the cluster and the requests), `report` (the files), `__main__` (the command line).
"""
