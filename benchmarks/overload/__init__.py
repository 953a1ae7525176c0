"""Overload ramp: goodput and TTFT of admitted requests from 50% to 150% of the sustained rate.

`python -m benchmarks.overload [--out DIR] [--quick] [--seeds ...]` starts 4 colocated sim
workers (the latency model of Llama-3.1-8B on an H100, run `--time-scale` times slower so
that two CPU cores can offer them more than they can serve), then:

1. builds, per seed, a pool of requests from Mooncake's conversation trace (module
   `workload`): whole sampled sessions, each row a completion request carrying its whole
   prompt, which shares its leading 512-token blocks with the rows that share its hash ids;
   a later turn waits for its previous turn's answer unless that turn was refused;
2. measures the sustained rate on those workers (module `calibrate`): short runs of our
   router without a deadline at rising offered rates, until completed requests/s stop
   growing or the median request misses its TTFT SLO;
3. offers every step of the ramp (50%, 75%, 100%, 125%, 150% of that rate), Poisson
   arrivals dealt to the sessions, to each system in turn on the same workers, caches
   flushed between runs: ours `prompt_tree` with admission by expected wait
   (`--max-expected-wait-secs D`), ours `prompt_tree` without it, and sglang-router
   `cache_aware` (its defaults). The client never retries: a 429 is a refused request.

Goodput, wait and the SLO are defined in module `slo`; the targets in `targets`. Writes
DIR/results.json, DIR/results.md and DIR/overload.png. Targets are reported, never asserted.
"""
