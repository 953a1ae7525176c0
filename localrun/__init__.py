"""Servers as processes on loopback: the launcher that tests, benchmarks and the deploy
scripts use, and the local cluster of CPU workers `python -m router` starts when it is
given no worker URLs."""
