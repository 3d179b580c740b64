"""Our forward-only Triton kernels for Bamba's Mamba2 mixer. Each op has a naive twin `<op>_ref` in reference/ops.py
with the same signature and return values, and a test file tests/kernels/test_<op>.py that compares the two."""

from .causal_conv1d import causal_conv1d, causal_conv1d_update
from .rms_norm import add_rms_norm
from .rms_norm_gated import rms_norm_gated
from .rotary import rotary_
from .row_top_k import row_top_k
from .selective_state_update import selective_state_update
from .silu_mul import silu_mul
from .ssd_scan import ssd_scan

__all__ = ["add_rms_norm", "causal_conv1d", "causal_conv1d_update", "rms_norm_gated", "rotary_", "row_top_k",
           "selective_state_update", "silu_mul", "ssd_scan"]
