"""Integer helpers of the ops' host code, in place of triton.cdiv and triton.next_power_of_2.

In triton 3.6 those two are constexpr functions: called from Python, each call costs ~4 µs of argument unwrapping
(JITCallable machinery), and a scan call made fifteen of them, some 60 µs of host time per call, as much as a
quarter of its GPU time at a 2K-token prefill piece (bench/latency.py). These are plain integer arithmetic.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (0 for n <= 0, as triton.next_power_of_2 returns for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
