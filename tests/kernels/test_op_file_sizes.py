"""Each file of vendored/ops reads in one sitting (issue 49): at most 500 lines. A kernel module holds the math
(ssd_scan_kernels.py, causal_conv1d_kernels.py); the launch choices and the host side (argument checks, grids, the
ops themselves) live in the op's own module beside it (ssd_scan.py, causal_conv1d.py), which imports the kernels and
is never imported by them (tests/test_import_graph.py)."""

from __future__ import annotations

import ast
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


def test_the_ops_are_importable_from_where_they_always_were():
    """The engine, bench/ and the peers' adapters import the ops from vendored.ops and from the op modules."""
    ops = importlib.import_module("vendored.ops")
    scan = importlib.import_module("vendored.ops.ssd_scan")
    conv = importlib.import_module("vendored.ops.causal_conv1d")
    assert scan.ssd_scan is ops.ssd_scan
    for name in ("causal_conv1d", "causal_conv1d_update"):
        assert getattr(conv, name) is getattr(ops, name)


def test_the_kernel_modules_hold_kernels_and_no_launch_choices():
    """A test or sweep replaces a launch chooser in the module where the op looks it up at call time (the host
    module). Were the kernel module to carry the name too, a replacement aimed there would change nothing, silently;
    without it, monkeypatch.setattr raises. The kernel modules define Triton kernels and the helpers they call only:
    read from their source (the interpreter adds its own names to a kernel module's namespace once a kernel runs)."""
    for name in ("ssd_scan_kernels", "causal_conv1d_kernels"):
        tree = ast.parse((OPS_DIR / f"{name}.py").read_text())
        functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        not_kernels = [f.name for f in functions
                       if not any("triton.jit" in ast.unparse(d) for d in f.decorator_list)]
        assert not not_kernels, f"{name} defines functions that are not @triton.jit: {not_kernels}"
        assert len(functions) >= 5, (name, [f.name for f in functions])
        others = [type(n).__name__ for n in tree.body if isinstance(n, (ast.ClassDef,))]
        assert not others, f"{name} defines classes: {others}"
        imported = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
        host = name.removesuffix("_kernels")
        assert host not in imported, f"{name} imports its host module {host}"
        bound = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        bound |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
        host_names = {"ssd_scan", "_block_sizes", "_Blocks", "_logical_chunks", "causal_conv1d", "causal_conv1d_update",
                      "_prefill_launch", "_update_launch", "LAUNCH_CHOOSERS", "PrefillLaunch", "UpdateLaunch"}
        assert not bound & host_names, f"{name} binds the host side's names {sorted(bound & host_names)}"
