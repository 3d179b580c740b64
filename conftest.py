"""Repository-wide pytest setup.

The Triton interpreter must be switched on before the first `@triton.jit` function is defined, so this runs
before any test module (and so any kernel module) is imported. On a machine with a CUDA device the kernels compile
for it instead.
"""

import contextlib
import fcntl
import os
import tempfile
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under the interpreter a pointer is a raw host address: an access outside the kernel's tensors reads or overwrites
# other memory instead of faulting. Every interpreted load and store is checked against its arguments' storages
# (tests/interpreter_bounds.py); BAMBA_BOUNDS_CHECK=0 turns that off.
if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("BAMBA_BOUNDS_CHECK", "1") != "0":
    from tests.interpreter_bounds import install as _install_bounds_check
    _install_bounds_check()

# pytest-xdist workers share the cores: each takes its share of them in torch threads (at least one), never more, or
# they fight (a module measured 18 s alone took 170 s with 2 threads in each of 2 workers on 2 cores). On CI's 2 cores
# that is one thread a worker; make test-gpu's 8 workers on a 16-core GPU machine get 2 each for their CPU oracles.
# BAMBA_TORCH_THREADS overrides (the mutation runner runs several pytest processes side by side).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0) if os.environ.get("PYTEST_XDIST_WORKER") else 0
_threads = max(1, (os.cpu_count() or 1) // _workers) if _workers else max(1, min(2, os.cpu_count() or 1))
torch.set_num_threads(int(os.environ.get("BAMBA_TORCH_THREADS", _threads)))

# `--engine NAME` and the (engine, scenario) parametrization of harness tests (harness/pytest_plugin.py).
# `--ops NAME`: whose Triton ops tests/kernels judges (tests/kernels/providers.py).
pytest_plugins = ["harness.pytest_plugin", "tests.kernels.ops_plugin"]


# make test-gpu runs several xdist workers on one GPU. Each worker's caching allocator keeps the memory of the
# largest test it ran, so idle workers came to hold most of the device (8 workers on an H200: 11-26 GB each, and two
# tests ran out of memory). After every test a worker returns what it caches to the device. Tests whose peak exceeds
# a worker's fair share (device memory / workers) carry xdist_group(LARGE_GPU_MEMORY), which --dist loadgroup runs
# one at a time on one worker; a test that needed that much without the mark gets a warning naming it.
LARGE_GPU_MEMORY = "large-gpu-memory"


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


# Several pytest processes may share one GPU (tests.kernels.conformance --parallel runs one per op provider): their
# large-gpu-memory tests also take a lock file, so that at most one of them runs on the device at a time, across
# processes as --dist loadgroup does within one. BAMBA_GPU_LOCK names the file.
GPU_LOCK = os.environ.get("BAMBA_GPU_LOCK", os.path.join(tempfile.gettempdir(), "bamba-harness-large-gpu-memory.lock"))


@contextlib.contextmanager
def _large_gpu_memory_lock(request):
    grouped = any(m.args[:1] == (LARGE_GPU_MEMORY,) for m in request.node.iter_markers("xdist_group"))
    # a child pytest that runs one isolated finding's test (tests/kernels/ops_plugin.py) runs under its parent's lock
    if not (grouped and torch.cuda.is_available()) or os.environ.get("BAMBA_ISOLATED_FINDING"):
        yield
        return
    with open(GPU_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)          # blocks while another process runs its large test
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _gpu_memory_returned(request):
    with _large_gpu_memory_lock(request):
        if _cuda_in_use():
            torch.cuda.reset_peak_memory_stats()
        yield
        if _cuda_in_use():
            _return_gpu_memory(request)


def _return_gpu_memory(request) -> None:
    peak = torch.cuda.max_memory_reserved()
    torch.cuda.empty_cache()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = torch.cuda.get_device_properties(0).total_memory / max(workers, 1)
    grouped = any(m.args[:1] == (LARGE_GPU_MEMORY,) for m in request.node.iter_markers("xdist_group"))
    if workers > 1 and peak > share and not grouped:
        warnings.warn(f"{request.node.nodeid} reserved {peak / 2**30:.1f} GiB of GPU memory, more than one of "
                      f"{workers} workers' share ({share / 2**30:.1f} GiB): mark it "
                      f"pytest.mark.xdist_group({LARGE_GPU_MEMORY!r})", stacklevel=1)
