"""Repository-wide pytest setup.

The Triton interpreter must be switched on before the first `@triton.jit` function is defined, so this runs
before any test module (and so any kernel module) is imported. On a machine with a CUDA device the kernels compile
for it instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist already fills the cores with one worker each: one torch thread per worker, or they fight (a module
# measured 18 s alone took 170 s with 2 threads in each of 2 workers on 2 cores).
# BAMBA_TORCH_THREADS overrides (the mutation runner runs several pytest processes side by side).
_threads = 1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1))
torch.set_num_threads(int(os.environ.get("BAMBA_TORCH_THREADS", _threads)))

# `--engine NAME` and the (engine, scenario) parametrization of harness tests (harness/pytest_plugin.py).
pytest_plugins = ["harness.pytest_plugin"]
