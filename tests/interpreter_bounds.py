"""A bounds check for Triton's interpreter: every load and store a kernel makes (the lanes its mask keeps) must lie
inside the storage of one of the tensors the kernel was given.

Under the interpreter a pointer is a raw host address, so an access past a tensor's storage does not fault as it
may on a GPU: a load returns whatever memory lies there, and a store overwrites it, which can be another tensor or
Python's own objects (a later, unrelated error, or a wrong number, that changes from run to run). With this check
such an access fails at once, naming the kernel, the access and the first address outside every argument.

`install()` patches triton.runtime.interpreter (idempotent); conftest.py installs it for every test session run
under the interpreter unless BAMBA_BOUNDS_CHECK=0.
"""

from __future__ import annotations

import numpy as np

_state = {"ranges": None, "kernel": None}


class OutOfBoundsAccess(AssertionError):
    pass


def _storage_ranges(args) -> np.ndarray:
    """(lo, hi) byte ranges of the storages of every tensor among args (tuples searched), sorted by lo."""
    found = []

    def visit(arg):
        if isinstance(arg, (tuple, list)):
            for item in arg:
                visit(item)
        elif hasattr(arg, "untyped_storage") and hasattr(arg, "data_ptr"):
            storage = arg.untyped_storage()
            if storage.nbytes() > 0:
                found.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    visit(args)
    return np.array(sorted(found), dtype=np.uint64).reshape(-1, 2)


def _check(kind: str, ptrs, mask) -> None:
    ranges = _state["ranges"]
    if ranges is None:
        return
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    keep = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
    addresses = addresses[keep]
    if addresses.size == 0:
        return
    size = np.uint64(np.dtype(_element_np_dtype(ptrs)).itemsize)
    if ranges.shape[0] == 0:
        bad = addresses
    else:
        # the range whose start is the last one <= the address must also hold its last byte
        index = np.searchsorted(ranges[:, 0], addresses, side="right").astype(np.int64) - 1
        inside = index >= 0
        hi = ranges[np.maximum(index, 0), 1]
        inside &= addresses + size <= hi
        bad = addresses[~inside]
    if bad.size:
        raise OutOfBoundsAccess(
            f"{_state['kernel']}: a masked-in {kind} of {bad.size} of {addresses.size} lanes lies outside every "
            f"tensor argument's storage (first at address {int(bad[0]):#x}; argument storages: "
            + ", ".join(f"[{int(lo):#x}, {int(hi):#x})" for lo, hi in ranges) + ")")


def _element_np_dtype(ptrs):
    from triton.runtime.interpreter import _get_np_dtype
    return _get_np_dtype(ptrs.get_element_ty())


def install() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_bamba_bounds_check", False):
        return
    interpreter._bamba_bounds_check = True
    builder = type(interpreter.interpreter_builder)
    load, store = builder.create_masked_load, builder.create_masked_store

    def create_masked_load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
        _check("load", ptrs, mask)
        return load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_modifier, eviction_policy):
        _check("store", ptrs, mask)
        return store(self, ptrs, value, mask, cache_modifier, eviction_policy)

    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store

    executor = interpreter.GridExecutor
    init_args = executor._init_args_hst

    def _init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _state["ranges"] = _storage_ranges([args_hst, list(kwargs_hst.values())])
        _state["kernel"] = getattr(self.fn, "__name__", "a kernel")
        return args_hst, kwargs_hst

    executor._init_args_hst = _init_args_hst
