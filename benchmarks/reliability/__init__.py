"""Reliability under faults and bad inputs: real processes broken with real signals, or
pushed past their memory and capacity.

`python -m benchmarks.reliability --out DIR` runs every fault scenario (`faults`,
`pd_faults`, and the pressure rows of `pressure`) and every bad input (`bad_inputs`) and
writes the table (`report`).
"""
