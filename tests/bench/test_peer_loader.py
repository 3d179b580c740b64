"""bench/peer_loader.py's stand-ins for vLLM's non-Triton modules behave as modules do, so that importing another peer
after vLLM's ops works: on an H200 (2026-12-04) `make bench-kernels` lost fla as a scan peer because fla's import
asked every module in sys.modules for `__file__` (inspect.getmodule) and the vllm._custom_ops stand-in raised."""

from __future__ import annotations

import inspect

import pytest

from bench.peer_loader import _NoCompiledOps


def test_compiled_ops_stand_in_answers_the_module_protocol(monkeypatch):
    ops = _NoCompiledOps("vllm._custom_ops")
    assert inspect.ismodule(ops)
    assert not hasattr(ops, "__file__") and not hasattr(ops, "__path__")
    monkeypatch.setitem(__import__("sys").modules, "vllm_custom_ops_stand_in_under_test", ops)
    # what fla's import ran into: a lookup that walks sys.modules asking each module for __file__ (a code object
    # has no __module__ to shortcut it)
    assert inspect.getmodule((lambda: 0).__code__, "/no/such/file.py") is None


def test_compiled_ops_stand_in_still_refuses_every_compiled_op():
    with pytest.raises(NotImplementedError, match="vllm._custom_ops.selective_scan_fwd: a compiled vLLM op"):
        _NoCompiledOps("vllm._custom_ops").selective_scan_fwd
