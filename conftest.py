"""Repository-wide pytest setup.

The Triton interpreter must be switched on before the first `@triton.jit` function is defined, so this runs
before any test module (and so any kernel module) is imported. On a machine with a CUDA device the kernels compile
for it instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep CPU runs deterministic and from oversubscribing the cores that pytest-xdist already fills.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# `--engine NAME` and the (engine, scenario) parametrization of harness tests (harness/pytest_plugin.py).
pytest_plugins = ["harness.pytest_plugin"]
