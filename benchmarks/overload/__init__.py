"""Overload ramp: goodput and TTFT of admitted requests from 50% to 150% of the sustained rate.

`python -m benchmarks overload`: per seed a request pool from the conversation trace
(`workload`), the sustained rate measured on the workers (`calibrate`), then every step of
the ramp offered to each system in turn (`runner`); goodput, wait and the SLO in `slo`, the
targets in `targets`. docs/benchmarks/overload.md has the method and the figures.
"""
