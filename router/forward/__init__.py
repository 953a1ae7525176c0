"""The path of an inference request once it is read, in the order it runs: `dispatch`
chooses the worker (or PD pair) and sends with sglang-router's retry rules, `relay` runs one
exchange with a worker (timeouts, retries before the first byte, the stream passed through
and parsed), `upstream` is the HTTP client it sends with, `reply` is where the answer goes
(whole or streamed), and `feedback` is what the answer teaches afterwards (breakers, cached
tokens, the next turn's prefix in the trees)."""
