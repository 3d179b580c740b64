"""Every kernel specialisation the ops launch compiles for sm_90 (H100/H200) with the pinned triton, on a machine
without a GPU: the interpreter never compiles, so a kernel that only the compiler rejects (a tl.dot under 16, a
dtype mismatch in a loop-carried value, a non-constexpr shape) would otherwise first fail on a GPU. The check also
fails a kernel that spills registers, or a product kernel of the scan that leaves Hopper's wgmma (see
vendored/ops/_compile_check.py): slow-downs that no CPU test could otherwise see."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "vendored.ops._compile_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"compile check failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "kernel specialisations compiled for sm_90" in proc.stdout, proc.stdout[-2000:]
