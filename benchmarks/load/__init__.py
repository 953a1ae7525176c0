"""The one load layer every benchmark sends through.

`record.Record` is what a client saw of one request; `send.send` sends one body (streaming
or not) and fills a record: status, TTFT, end to end, token counts, the answer, or the kind
of error. `bodies` builds the requests' bodies, `retry` answers a 429. The drivers decide
when requests go: `causal` (multi-turn sessions with arrival times), `open_loop` (Poisson
arrivals for a duration) and `closed_loop` (N clients as fast as they can for a window).
"""
