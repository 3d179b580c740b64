"""Each file of vendored/ops reads in one sitting (issue 49): at most 500 lines. A kernel file holds the math; the
launch choices and the host side (argument checks, grids, the Python wrapper) live in modules of their own beside it,
e.g. ssd_scan_launch.py and causal_conv1d_launch.py, and the ops stay importable from where they always were."""

from __future__ import annotations

import importlib
from pathlib import Path

OPS_DIR = Path(__file__).resolve().parents[2] / "vendored" / "ops"
MAX_LINES = 500


def test_no_op_file_is_over_500_lines():
    files = sorted(OPS_DIR.rglob("*.py"))
    assert len(files) > 10, f"no op files found under {OPS_DIR}"
    lengths = {str(p.relative_to(OPS_DIR)): len(p.read_text().splitlines()) for p in files}
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not too_long, (f"over {MAX_LINES} lines: {too_long}; move launch choices and host-side dispatch into a "
                          "module of their own beside the kernels (as ssd_scan_launch.py)")


def test_the_ops_stay_importable_from_their_kernel_modules():
    """The engine and bench/ import the ops from the kernel modules and from vendored.ops: the same functions the
    host modules define."""
    ops = importlib.import_module("vendored.ops")
    scan, scan_launch = (importlib.import_module(f"vendored.ops.{m}") for m in ("ssd_scan", "ssd_scan_launch"))
    conv, conv_launch = (importlib.import_module(f"vendored.ops.{m}")
                         for m in ("causal_conv1d", "causal_conv1d_launch"))
    assert scan.ssd_scan is scan_launch.ssd_scan is ops.ssd_scan
    for name in ("causal_conv1d", "causal_conv1d_update"):
        assert getattr(conv, name) is getattr(conv_launch, name) is getattr(ops, name)
    for name in ("PrefillLaunch", "UpdateLaunch"):
        assert getattr(conv, name) is getattr(conv_launch, name)


def test_the_kernel_modules_do_not_re_export_the_launch_choosers():
    """A test or sweep replaces a launch chooser in the module where the op looks it up at call time (the host
    module). Were the kernel module to carry the name too, a replacement aimed there would change nothing, silently;
    without it, monkeypatch.setattr raises."""
    scan = importlib.import_module("vendored.ops.ssd_scan")
    conv = importlib.import_module("vendored.ops.causal_conv1d")
    for name in ("_block_sizes", "_Blocks", "_logical_chunks"):
        assert not hasattr(scan, name), name
    for name in ("_prefill_launch", "_update_launch", "LAUNCH_CHOOSERS"):
        assert not hasattr(conv, name), name
