"""Findings against the peers' kernels: each a strict xfail of the test that exposes it under `--ops PROVIDER`, with
its number (the worst error in units of the test's tolerance, or what went wrong), its cause, and a reproducer under
findings/ that runs without pytest. A failure that was our adapter's fault (tests/kernels/providers.py) was fixed
there, not listed here. docs/kernel-conformance.md has the table these feed."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass


@dataclass(frozen=True)
class PeerFinding:
    key: str                       # a short name, as in docs/kernel-conformance.md
    providers: tuple[str, ...]     # --ops names it holds for
    tests: tuple[str, ...]         # fnmatch patterns of node ids (relative to the repository root)
    number: str                    # what was measured
    cause: str
    reproducer: str                # findings/<file>.py

    def reason(self) -> str:
        return f"finding {self.key}: {self.number}; {self.cause} (python {self.reproducer})"


_SCAN = "tests/kernels/test_ssd_scan.py::"
FINDINGS: tuple[PeerFinding, ...] = (
    PeerFinding(
        "vllm-0.7.3-mid-chunk-initial-state", ("vllm-0.7.3",),
        tuple(_SCAN + t for t in (
            "test_packed_sequences_mixed_initial_states[[]inside-chunks[]]",
            "test_packed_sequences_mixed_initial_states[[]length-1-seqs[]]",
            "test_packed_sequences_mixed_initial_states[[]two-long[]]",
            "test_packed_sequences_all_or_no_initial_states[[]all[]]", "test_groups[[]*",
            "test_chunk_sizes[[]Q8-below-block[]]", "test_chunk_sizes[[]Q24-not-power-of-2[]]",
            "test_16bit_input_with_fp32_state_pool", "test_rounded_products[[]two-long-fp16-*",
            "test_rounded_products[[]no-z-no-D-fp16-*", "test_bamba_9b_shapes*")),
        "y off by up to 5.04 (5.0e4 times the fp32 tolerance) for a sequence that starts inside a chunk of the "
        "packed batch with an initial state",
        "its scan cuts chunks from the batch's token 0 and a sequence beginning mid-chunk does not start from its "
        "own initial state (0.10.2's chunk_indices/chunk_offsets fixed it)",
        "findings/vllm_073_scan_initial_state_mid_chunk.py"),
    PeerFinding(
        "vllm-0.7.3-16bit-chunk-states", ("vllm-0.7.3",),
        (_SCAN + "test_rounded_products[[]chunk-edges-fp16-*", _SCAN + "test_rounded_products[[]Q72-*-fp16-*"),
        "final states up to 1.1 times the bound of the peers' own precision class (rounded products), fp16 inputs",
        "_state_passing_fwd stores the states passed between chunks in the input's dtype (out_dtype=C.dtype), a "
        "rounding that later releases' state_dtype removed; the final states are built on them",
        "findings/vllm_kernels.py vllm-0.7.3-16bit-chunk-states"),
    PeerFinding(
        "vllm-no-dt-bias-final-state", ("vllm", "vllm-0.10.2", "vllm-0.7.3"),
        (_SCAN + "test_without_optional_input[[]dt_bias[]]",),
        "one final-state element of 1,024 at 1.2 times the fp32 tolerance (3.5e-6 against 2.9e-6) when dt_bias is "
        "None",
        "not isolated, and no wrong arithmetic found: 9 fp32 ulps of a 3.36 state, against an atol calibrated on our "
        "kernel; its softplus (log(exp(dt) + 1), not log1p) is not it (an accurate form leaves 3.4e-6); with "
        "dt_bias the test passes, and vLLM's mixers always pass dt_bias",
        "findings/vllm_kernels.py vllm-no-dt-bias-final-state"),
    PeerFinding(
        "vllm-conv-16bit-products", ("vllm", "vllm-0.10.2"),
        # what failed: on the CPU the fp16 tests; on the H100 the Bamba-9B shapes but the decode update at batch 1
        ("tests/kernels/test_causal_conv1d.py::test_16bit_inputs[[]fp16[]]",
         "tests/kernels/test_causal_conv1d.py::test_bamba_shapes_8k_tokens[[]*",
         "tests/kernels/test_causal_conv1d_update.py::test_16bit_inputs[[]fp16[]]",
         "tests/kernels/test_causal_conv1d_update.py::test_bamba_shapes[[]*-B7[]]",
         "tests/kernels/test_causal_conv1d_update.py::test_bamba_shapes[[]*-B256[]]"),
        "fp16 on the CPU: outputs up to 17.8 times the bound (prefill, 11,711 of 250,880 outside it) and 9.65 "
        "times (decode update, 471 of 32,768); bf16 and fp16 at Bamba-9B widths on an H100: up to 35 times",
        "both Triton conv kernels multiply the 16-bit input and weight in 16 bits (acc += matrix_x * matrix_w: "
        "Triton keeps a bf16 or fp16 product in its dtype), so each of the W tap products is rounded before the "
        "fp32 sum, and where the taps cancel the error is many roundings of the result; with the product in fp32 "
        "(matrix_x.to(tl.float32) * matrix_w.to(tl.float32)) the same tests pass. 0.7.3's conv is a CUDA extension",
        "findings/vllm_kernels.py vllm-conv-16bit-products"),
)


def finding_for(provider: str, nodeid: str) -> PeerFinding | None:
    for finding in FINDINGS:
        if provider in finding.providers and any(fnmatch.fnmatchcase(nodeid, p) for p in finding.tests):
            return finding
    return None
