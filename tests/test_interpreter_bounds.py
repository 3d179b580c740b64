"""tests/interpreter_bounds.py: an interpreted kernel's access outside its arguments' storages fails, and accesses
inside them (masked lanes outside them included) pass."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from tests.interpreter_bounds import OutOfBoundsAccess, install

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter")


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, shift, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    values = tl.load(src_ptr + offs + shift, mask=offs < n)
    tl.store(dst_ptr + offs, values, mask=offs < n)


@triton.jit
def _store_past_kernel(dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs <= n)   # one lane too many


def test_accesses_inside_the_arguments_pass():
    install()
    src, dst = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    _copy_kernel[(1,)](src, dst, 10, 0, BLOCK=16)          # lanes 10-15 masked off: outside, not accessed
    assert torch.equal(dst, src)


def test_a_view_may_reach_the_rest_of_its_storage():
    install()
    base = torch.arange(20, dtype=torch.float32)
    dst = torch.zeros(10)
    _copy_kernel[(1,)](base[5:15], dst, 10, 5, BLOCK=16)   # reads base[10:20]: past the view, inside the storage
    assert torch.equal(dst, base[10:20])


def test_a_load_past_the_storage_fails():
    install()
    src, dst = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    with pytest.raises(Exception, match="_copy_kernel: a masked-in load of 1 of 10 lanes lies outside") as info:
        _copy_kernel[(1,)](src, dst, 10, 1, BLOCK=16)
    assert isinstance(info.value, OutOfBoundsAccess) or isinstance(info.value.__cause__, OutOfBoundsAccess)


def test_a_store_past_the_storage_fails():
    install()
    dst = torch.zeros(10)
    with pytest.raises(Exception, match="_store_past_kernel: a masked-in store of 1 of 11 lanes lies outside"):
        _store_past_kernel[(1,)](dst, 10, BLOCK=16)
