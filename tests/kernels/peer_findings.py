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
    # patterns that hold only where the tests run on CUDA (bf16 products the interpreter keeps in fp32, Triton's
    # TF32 dots, offsets the interpreter's numpy arrays never wrap)
    cuda_tests: tuple[str, ...] = ()
    # the failure breaks the process (a CUDA illegal memory access poisons its context for every later test): the
    # test runs in a child process of its own, and the child's failure is this test's (tests/kernels/ops_plugin.py)
    isolate: bool = False

    def patterns(self, cuda: bool) -> tuple[str, ...]:
        return self.tests + (self.cuda_tests if cuda else ())

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
        "times (decode update, 471 of 32,768); bf16 and fp16 at Bamba-9B widths on an H100: up to 35 times; bf16 "
        "on an H100 (the interpreter computes bf16 products in fp32): 22.6 times (prefill, 7,613 of 250,880) and "
        "7.0 times (decode update, 340 of 32,768)",
        "both Triton conv kernels multiply the 16-bit input and weight in 16 bits (acc += matrix_x * matrix_w: "
        "Triton keeps a bf16 or fp16 product in its dtype), so each of the W tap products is rounded before the "
        "fp32 sum, and where the taps cancel the error is many roundings of the result; with the product in fp32 "
        "(matrix_x.to(tl.float32) * matrix_w.to(tl.float32)) the same tests pass. 0.7.3's conv is a CUDA extension",
        "findings/vllm_kernels.py vllm-conv-16bit-products",
        cuda_tests=("tests/kernels/test_causal_conv1d.py::test_16bit_inputs[[]bf16[]]",
                    "tests/kernels/test_causal_conv1d_update.py::test_16bit_inputs[[]bf16[]]")),
    PeerFinding(
        "vllm-0.10.2-conv-int32-token-offsets", ("vllm-0.10.2",), (),
        "CUDA error: an illegal memory access (270,000 tokens of 8,448 channels; every later test of the process "
        "fails with it)",
        "the prefill conv forms a sequence's first element as sequence_start_index * stride_x_token with the start "
        "an int32 load and the stride a tl.constexpr, in int32: past 2^31 elements the offset wraps negative; 0.33.0 "
        "types the strides tl.int64 and widens the index, and passes",
        "findings/vllm_kernels.py vllm-0.10.2-conv-int32-token-offsets",
        cuda_tests=("tests/kernels/test_causal_conv1d.py::test_long_prefill_past_int32_offsets",), isolate=True),
    PeerFinding(
        "vllm-0.10.2-scan-int32-chunk-offsets", ("vllm-0.10.2",), (),
        "CUDA error: an illegal memory access (72,000 tokens in rows of 32,768 elements, initial states given: "
        "offsets past 2^31); the first failure of its process, every later test of which failed with it",
        "with initial states its chunk scan loads the chunk index from chunk_indices, an int32 tensor (as vLLM "
        "0.10.2's own metadata builds it, dtype=torch.int), and forms c_idx * chunk_size * stride_x_seqlen in "
        "int32: past 2^31 elements the offset wraps. 0.33.0 types the strides tl.int64 and passes",
        "findings/vllm_kernels.py vllm-0.10.2-scan-int32-chunk-offsets",
        cuda_tests=(_SCAN + "test_long_input_offsets_past_int32",), isolate=True),
    PeerFinding(
        "fp32-scan-tf32-dots", ("vllm", "vllm-0.10.2", "fla"), (),
        "fp32 inputs and state at Bamba-9B widths, 4,096 tokens, on an H100: y up to 1.7e3 times the fp32 bound "
        "under vLLM 0.33.0 and 0.10.2 alike (0.182 on -104.2; 4,394,795 of 5,292,032 elements outside it), 1.6e3 "
        "under fla-core 0.6.0 (0.166 on 87.1)",
        "the chunk kernels' tl.dot calls give no input_precision, and Triton's default on NVIDIA GPUs is TF32 for "
        "fp32 operands (10-bit mantissas): a model served in fp32 gets TF32 arithmetic in its SSM layers. The "
        "interpreter computes the dots in fp32, so the CPU table passes",
        "findings/vllm_kernels.py fp32-scan-tf32-dots",
        cuda_tests=(_SCAN + "test_bamba_9b_shapes[[]fp32-*",)),
    PeerFinding(
        "fla-16bit-final-states-fp32-pool", ("fla",), (),
        "final states into an fp32 pool from 16-bit inputs at Bamba-9B widths on an H100: up to 1.09 times the "
        "bound of the peers' precision class (bf16, 14 of 1,048,576 elements; fp16 1.00 times, 1 element); y "
        "passes, and so do the same shapes with a bf16 pool",
        "not isolated: the bound allows one rounding of B·decay·Δ to the input dtype (the peers' stage 2), and "
        "fla's chunk_h rounds k·exp(g) to the input dtype where the adapter has already rounded v = x·Δ to it (fla "
        "takes v in one dtype with q and k): two roundings where the bound allows one; either this or fla's own "
        "arithmetic, unresolved without a GPU",
        "findings/vllm_kernels.py fla-16bit-final-states-fp32-pool",
        cuda_tests=tuple(_SCAN + t for t in (
            "test_bamba_9b_shapes[[]bf16-state_fp32-T2048[]]", "test_bamba_9b_shapes[[]bf16-state_fp32-T8192[]]",
            "test_bamba_9b_shapes[[]fp16-state_fp32-T8192[]]",
            "test_bamba_9b_shapes_rounded_products[[]bf16-state_fp32-T8192[]]",
            "test_bamba_9b_shapes_rounded_products[[]fp16-state_fp32-T8192[]]",
            "test_long_input_offsets_past_int32"))),
    PeerFinding(
        "vllm-0.10.2-16bit-final-state-bf16-pool", ("vllm-0.10.2",), (),
        "fp16 inputs, final states into a bf16 pool at Bamba-9B widths, 2,048 tokens, on an H100: 1 of 1,048,576 "
        "elements of sequence 3's final state 1.19 times the bound (-0.000162 where the fp64 twin has -0.00154 and "
        "the fp16 twin -0.00154); y passes; the test failed in each of three H100 runs (2026-12-06); vLLM 0.33.0 and "
        "our kernels pass it",
        "not isolated: an element whose terms nearly cancel, so one extra rounding of a 16-bit product or partial "
        "state in 0.10.2's chunk-state path (which 0.33.0 reworked) would show there first",
        "findings/vllm_kernels.py vllm-0.10.2-16bit-final-state-bf16-pool",
        cuda_tests=(_SCAN + "test_bamba_9b_shapes[[]fp16-state_bf16-T2048[]]",)),
)


def finding_for(provider: str, nodeid: str, cuda: bool) -> PeerFinding | None:
    """The finding pinned on this test under this provider, on CUDA (`cuda`) or under the interpreter."""
    for finding in FINDINGS:
        if provider in finding.providers and any(fnmatch.fnmatchcase(nodeid, p) for p in finding.patterns(cuda)):
            return finding
    return None
