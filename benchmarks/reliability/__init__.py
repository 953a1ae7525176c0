"""Reliability under faults, pressure and bad inputs: real router and worker processes broken
with real signals, pushed past their memory and capacity, sent malformed and hostile requests."""
