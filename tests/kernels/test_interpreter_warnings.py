"""The Triton interpreter's NumPy deprecation warning (thousands per run, none about our code) is filtered by
pyproject.toml's filterwarnings, by message and module only: a kernel call under the interpreter leaves no
DeprecationWarning in the test, while the same warning raised from anywhere else still shows."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from vendored.ops.rms_norm_gated import rms_norm_gated

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _recorded(action) -> list[warnings.WarningMessage]:
    """The warnings `action` raises that the active filters (pytest's, from pyproject.toml) let through."""
    with warnings.catch_warnings(record=True) as seen:       # keeps the filters in force, unlike recwarn
        action()
    return list(seen)


@pytest.mark.skipif(not INTERPRETED, reason="the warning comes from the Triton interpreter (CPU runs)")
def test_an_interpreted_kernel_call_leaves_no_deprecation_warning():
    x = torch.randn(4, 64)
    seen = _recorded(lambda: rms_norm_gated(x, torch.randn(4, 64), torch.ones(64), eps=1e-5, group_size=64,
                                            norm_before_gate=False))
    assert not [w for w in seen if issubclass(w.category, DeprecationWarning)], [str(w.message) for w in seen]


def test_the_filter_is_not_wholesale():
    seen = _recorded(lambda: warnings.warn("Conversion of an array with ndim > 0 to a scalar is deprecated",
                                           DeprecationWarning))
    assert [w.category for w in seen] == [DeprecationWarning]
