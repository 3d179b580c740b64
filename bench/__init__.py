"""Benchmarks (run on a GPU; each has a CPU smoke mode that the test suite runs)."""
