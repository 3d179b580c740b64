"""vendored/ops/_host.py: the host's integer helpers agree with triton's (which cost ~4 µs a call in triton 3.6)."""

import triton

from vendored.ops._host import cdiv, next_power_of_2


def test_cdiv_matches_triton():
    for a in range(0, 600):
        for b in (1, 2, 3, 16, 29, 64, 128, 256, 257):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_power_of_2_matches_triton():
    for n in [*range(0, 4100), 2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
