"""bench/scan_compiled_form.py end to end on a CPU, in both precision modes: it compiles the scan's three product
kernels (the GPU's launch: the tile kernels of stages 2 and 4) for sm_90 and reports each one's registers, its tensor-core products and its shared-memory traffic (what the 2026-12-04 analysis of the
scan read from it, docs/kernels.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("products", ["fp32", "rounded"])
def test_reports_every_product_kernel(tmp_path, products):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "bench.scan_compiled_form", "--products", products,
                           "--dump", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for kernel in ("_ssd_chunk_state_tile_kernel", "_ssd_bmm_chunk_fwd_kernel", "_ssd_chunk_scan_tile_kernel"):
        report = re.search(rf"^{kernel}: (\d+) registers.*\n  TTGIR (.*)\n  PTX   (.*)$", proc.stdout, re.M)
        assert report, f"no report for {kernel}:\n{proc.stdout}"
        assert int(report.group(1)) > 0
        wgmma = int(re.search(r"warp_group_dot (\d+)", report.group(2)).group(1))
        assert wgmma > 0, f"{kernel}: no wgmma in its TTGIR ({report.group(2)})"
        assert (tmp_path / f"{kernel}.ttgir").stat().st_size > 0 and (tmp_path / f"{kernel}.ptx").stat().st_size > 0
