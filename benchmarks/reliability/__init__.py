"""Reliability under faults and bad inputs: real processes broken with real signals.

`python -m benchmarks.reliability --out DIR` runs every fault scenario (`faults`,
`pd_faults`) and every bad input (`bad_inputs`) and writes the table (`report`).
"""
