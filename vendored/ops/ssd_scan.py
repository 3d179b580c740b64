"""The SSD chunked scan's host side, whose kernels (the math) are vendored/ops/ssd_scan_kernels.py and
ssd_scan_tiles.py (which import nothing from here): argument checks; the launch choices (_Blocks, _block_sizes: the
only place that chooses tiles, warps, pipelining stages and register caps); the table of logical chunks (_logical_chunks, stage 0's launch); each product's
precision (_dot's HOW, vendored/ops/ssd_scan_products.py); and the buffers, grids and launches of every stage, in
the op itself, `ssd_scan` (vendored.ops re-exports it). A test or sweep that replaces _block_sizes
replaces it here, where ssd_scan looks it up.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._host import cdiv, next_power_of_2
from ._index_check import no_check, start_index_check
from ._rounding import interpreted
from .ssd_scan_kernels import (_logical_chunks_kernel, _ssd_bmm_chunk_fwd_kernel, _ssd_chunk_cumsum_fwd_kernel,
                       _ssd_chunk_scan_fwd_kernel, _ssd_chunk_state_fwd_kernel, _ssd_state_passing_fwd_kernel)
from .ssd_scan_tiles import _ssd_chunk_scan_tile_kernel, _ssd_chunk_state_tile_kernel

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _logical_chunks(cu_seqlens: torch.Tensor, chunk_size: int, n_tokens: int):
    """Cut every sequence into chunks of at most Q tokens counted from its own first token.

    cu_seqlens (B+1,). Returns chunk_start (NC,), chunk_len (NC,) and seq_chunks (B+1,), int32 on cu_seqlens' device:
    sequence b owns chunks seq_chunks[b]:seq_chunks[b+1]. The real count Σ_b ceil(L_b / Q) is at most
    NC = T // Q + B, which is known without reading cu_seqlens back to the host (no device sync): chunks past the
    real count get length 0 (and start 0) and every stage skips them. One kernel launch: at a chunked-prefill
    budget of 2K tokens the scan's own work is a few tens of microseconds, as much as a dozen small torch ops cost
    the host.
    """
    n_seqs = cu_seqlens.numel() - 1
    n_chunks = n_tokens // chunk_size + n_seqs
    i32 = dict(dtype=torch.int32, device=cu_seqlens.device)
    chunk_start, chunk_len, seq_chunks = torch.empty(n_chunks, **i32), torch.empty(n_chunks, **i32), \
        torch.empty(n_seqs + 1, **i32)
    block_c = 256 if cu_seqlens.device.type == "cuda" else 1024
    _logical_chunks_kernel[(cdiv(n_chunks, block_c),)](
        cu_seqlens, chunk_start, chunk_len, seq_chunks, n_seqs, n_chunks, chunk_size,
        BLOCK_C=block_c, BLOCK_B=min(64, next_power_of_2(max(n_seqs, 1))),
    )
    return chunk_start, chunk_len, seq_chunks


class _Blocks(NamedTuple):
    """How the scan cuts its work. chunk: the length of its chunks (the model's chunk_size by default, though any
    length computes the same recurrence: chunks cut the work, they are not part of what is computed); q: a chunk
    padded to a power of two; m: the rows (and columns) of a stage-4 tile and of a C·Bᵀ tile; p: head-dim columns
    of a state or y tile; n_state, n_pass, n_scan: state columns of a stage-2 tile, of a stage-3 tile and of a
    stage-4 C·S step; h_cumsum: heads per stage-1 program; c, h: chunks and heads (groups, for C·Bᵀ) per program of
    every stage that has them; warps, stages: num_warps and num_stages (software pipelining depth) of the stages
    with products; tensor_cores: whether 16-bit inputs take the tensor-core products of _dot (GPU) or fp32 FMAs;
    max_registers: a cap on the registers a thread of stages 2 and 4 may use when x is bf16 (ptxas's maxnreg; 0:
    none), which sets how many of their programs an SM holds at once (65536 registers an SM, 128 threads a program);
    scan_m, scan_k, scan_p, scan_warps, scan_stages, scan_max_registers: stage 4's rows, column step, head-dim columns,
    warps, stages and register cap when not 0 (otherwise m, m, p, warps, stages and max_registers), for the sweep to
    vary stage 4 alone (scan_m may not exceed m: stage 4 reads the C·Bᵀ tiles on and below the diagonal, in m-row
    blocks)."""
    chunk: int
    q: int
    m: int
    p: int
    n_state: int
    n_pass: int
    n_scan: int
    h_cumsum: int
    c: int
    h: int
    warps: int
    stages: int
    tensor_cores: bool
    max_registers: int = 0
    scan_m: int = 0
    scan_k: int = 0
    scan_p: int = 0
    scan_warps: int = 0
    scan_stages: int = 0
    scan_max_registers: int = 0


def _block_sizes(chunk_size: int, n_heads: int, head_dim: int, d_state: int, products: str,
                 device: torch.device) -> _Blocks:
    """tl.dot needs every side >= 16, so q, m, p and n are padded up to that. GPU: one chunk and one head per program
    past stage 1 (the grid supplies the parallelism): 2-D tiles, which Triton maps onto Hopper's wgmma; a whole (64,
    128) state per stage-2 program, so x·decay is split into bf16 pieces once. Stage 1 takes 8 heads per program
    whatever H is: with 4 (a model of 4 heads), triton 3.6 fails to compile it for sm_90 ("operand does not dominate
    this use" in its layout pass; _compile_check compiles the scan at such a shape). Picked on an H200 with
    bench/sweep_scan.py (2026-11-30, Bamba-9B, 32K and 2K tokens): (64, 64) stage-3 tiles and no software pipelining
    (num_stages 1: less shared memory, more programs per SM) were the fastest of the variations tried; 8 warps, 32-
    or 128-wide C·S steps, 4 stages and chunks of 64 or 128 were slower. Registers capped at 168 a thread (stage 4
    needed 208 uncapped in its batched form, 160 as a tile kernel; stage 2 174: two 128-thread programs an SM; at 168
    three fit, with no spills, and the same results bit for bit): 14% less time at 32K tokens, 8% at 2K
    (bench/sweep_scan.py, H200); 128 (four programs, some spills) and 8 warps at 128 were slower. products="rounded"
    (2026-12-04, by device time at 2K-32K tokens): stage 4 capped at 128 registers, its C·S read-out in one 128-wide
    step; stage 2 stays at 168 (its two bf16 products spill 480 bytes at 128). Interpreter, where every program costs
    the same fixed time whatever its size: 256 rows' worth of chunks (16 chunks of Q <= 16, 4 of Q = 128) and up to 4
    heads per program, so that tests with more chunks or heads than that still cross block edges."""
    block_q = max(16, next_power_of_2(chunk_size))
    block_m = min(64, block_q)
    block_p = min(64, max(16, next_power_of_2(head_dim)))
    block_n = max(16, next_power_of_2(d_state))
    heads_cumsum = next_power_of_2(n_heads)
    if device.type == "cuda":
        rounded = products == "rounded"
        return _Blocks(chunk=chunk_size, q=block_q, m=block_m, p=block_p, n_state=min(128, block_n),
                       n_pass=min(64, block_n), n_scan=min(128 if rounded else 64, block_n), h_cumsum=8, c=1, h=1,
                       warps=4, stages=1, tensor_cores=True, max_registers=168,
                       scan_max_registers=128 if rounded else 0)
    return _Blocks(chunk=chunk_size, q=block_q, m=block_m, p=block_p, n_state=min(64, block_n),
                   n_pass=min(64, block_n), n_scan=min(64, block_n), h_cumsum=min(16, heads_cumsum),
                   c=256 // block_m, h=min(4, heads_cumsum), warps=4, stages=1, tensor_cores=False)


def _check_shape(name: str, t: torch.Tensor | None, shape: tuple[int, ...], letters: str) -> None:
    if t is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {letters} = {shape}, got {tuple(t.shape)}")


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    z: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    check_indices: bool = True,
    products: str = "fp32",
) -> torch.Tensor:
    """The selective state-space recurrence over packed sequences, by the SSD chunked algorithm (Triton).

    x (T, H, P) fp32/bf16/fp16; dt (T, H); A (H,) negative; B, C (T, G, N) with H % G == 0; D (H,) or None;
    dt_bias (H,) or None; z (T, H, P) or None; cu_seqlens (B+1,) int; ssm_states (S, H, P, N) fp32 or bf16, updated in
    place: slot state_indices[b] receives sequence b's final state; state_indices (B,) int; has_initial_state (B,)
    bool: sequence b starts from slot state_indices[b] if set, from zeros otherwise. chunk_size Q ≥ 1 (any value;
    blocks are padded to a power of two ≥ 16). Any strides. Returns y (T, H, P) in x's dtype (see the module
    docstring for how that differs from the twin).

    The values of cu_seqlens and state_indices are checked (ValueError) by a device-to-host copy started before the
    kernels are queued and waited for after them (vendored/ops/_index_check.py); the kernels never read or write a
    slot outside the pool, so a call that raises has written only y and the slots it names. check_indices=False
    skips the copy and the wait, for a caller that built the values and vouches for them (the engine).

    products: "fp32" (default), every product and sum as accurate as fp32 (the module docstring says how); or
    "rounded", the peers' precision (vLLM's and mamba_ssm's kernels): each fp32 intermediate that meets a 16-bit input
    in a product (x·decay·Δ against B, the entering states against C, C·Bᵀ∘L·Δ against x) is rounded once to that
    input's dtype, and the cumulative sums of Δ·A run in fp32. Faster; its error against the fp64 twin is bounded in
    tests/kernels/test_ssd_scan.py by what those roundings can cost, and measured beside the peers' by bench/kernels.py.
    With an fp32 x the two are the same computation.
    """
    if products not in ("fp32", "rounded"):
        raise ValueError(f"products: expected 'fp32' or 'rounded', got {products!r}")
    if x.dim() != 3:
        raise ValueError(f"x: expected shape (T, H, P), got {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"x: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    if ssm_states.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"ssm_states: expected dtype float32 or bfloat16, got {ssm_states.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected ≥ 1, got {chunk_size}")
    n_tokens, n_heads, head_dim = x.shape
    if B.dim() != 3:
        raise ValueError(f"B: expected shape (T, G, N), got {tuple(B.shape)}")
    n_groups, d_state = B.shape[1:]
    n_seqs = state_indices.shape[0]
    _check_shape("dt", dt, (n_tokens, n_heads), "(T, H)")
    _check_shape("A", A, (n_heads,), "(H,)")
    _check_shape("C", C, tuple(B.shape), "(T, G, N)")
    _check_shape("B", B, (n_tokens, n_groups, d_state), "(T, G, N)")
    _check_shape("D", D, (n_heads,), "(H,)")
    _check_shape("dt_bias", dt_bias, (n_heads,), "(H,)")
    _check_shape("z", z, tuple(x.shape), "(T, H, P)")
    _check_shape("ssm_states", ssm_states, (ssm_states.shape[0], n_heads, head_dim, d_state), "(S, H, P, N)")
    _check_shape("has_initial_state", has_initial_state, (n_seqs,), "(B,)")
    _check_shape("cu_seqlens", cu_seqlens, (n_seqs + 1,), "(B+1,)")
    if n_heads % n_groups:
        raise ValueError(f"B: n_groups G = {n_groups} does not divide the number of heads H = {n_heads}")

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)                              # (T, H, P)
    check = (start_index_check(cu_seqlens, state_indices, n_tokens, ssm_states.shape[0]) if check_indices
             else no_check)
    if n_seqs == 0:
        check()
        return y
    half = (torch.bfloat16, torch.float16)
    rounded = products == "rounded" and x.dtype in half          # fp32 x: nothing to round to, the fp32 mode
    blocks = _block_sizes(chunk_size, n_heads, head_dim, d_state, "rounded" if rounded else "fp32", x.device)
    chunk_start, chunk_len, seq_chunks = _logical_chunks(cu_seqlens, blocks.chunk, n_tokens)
    n_chunks = chunk_start.shape[0]                                                       # NC (an upper bound)
    on_gpu = blocks.tensor_cores
    chunk_blocks = cdiv(n_chunks, blocks.c)
    head_blocks = cdiv(n_heads, blocks.h)
    m_blocks = blocks.q // blocks.m
    f32 = dict(dtype=torch.float32, device=x.device)
    # _dot's precision for each product (see its table): 16-bit operands take the tensor cores on the GPU only
    how_cb = 0 if on_gpu and B.dtype == C.dtype and B.dtype in half else 3
    if rounded:                # one rounding to the 16-bit operand's dtype (GPU: 4; interpreter: 6, the same math)
        # stage 2's products make the final states, which the next call starts from: x·decay·Δ as two bf16 pieces
        # there (8, 9), so the states are off by 2^-15 rather than bf16's 2^-8 (fp16 B: one rounding to fp16, 2^-11)
        how_xb = ({torch.bfloat16: 8 if on_gpu else 9, torch.float16: 4 if on_gpu else 6}.get(B.dtype, 3))
        how_cs = (0 if on_gpu else 3) if C.dtype in half else 3         # C @ state entering, stored in C's dtype
        how_x = (4 if on_gpu else 6) if x.dtype in half else 3          # (C·Bᵀ∘L·Δ) @ x         (stage 4)
    else:
        how_xb = 1 if on_gpu and B.dtype == torch.bfloat16 else 3       # (x·decay·Δ)ᵀ @ B       (stage 2)
        how_cs = 2 if on_gpu and C.dtype == torch.bfloat16 else 3       # C @ state entering    (stage 4)
        how_x = 1 if on_gpu and x.dtype == torch.bfloat16 else 3        # (C·Bᵀ∘L·Δ) @ x         (stage 4)

    # the register cap was measured for the tensor-core products (bf16 x); the fp32 FMA paths would spill under it
    registers = {"maxnreg": blocks.max_registers} if blocks.max_registers and how_x in (1, 4) else {}
    scan_cap = blocks.scan_max_registers or blocks.max_registers
    scan_registers = {"maxnreg": scan_cap} if scan_cap and how_x in (1, 4) else {}
    delta = torch.empty(n_chunks, n_heads, blocks.q, **f32)                              # (NC, H, Q)
    dA_cumsum = torch.empty(n_chunks, n_heads, blocks.q, dtype=torch.float32 if rounded else torch.float64,
                            device=x.device)                                              # (NC, H, Q)
    chunk_decay = torch.empty(n_chunks, n_heads, **f32)                                  # (NC, H)
    dt_min, dt_max = dt_limit
    has_dt_limit = dt_min > 0.0 or dt_max < math.inf
    _ssd_chunk_cumsum_fwd_kernel[(chunk_blocks, cdiv(n_heads, blocks.h_cumsum))](
        dt, A, dt_bias if dt_bias is not None else A, delta, dA_cumsum, chunk_decay, chunk_start, chunk_len,
        n_chunks, n_heads, float(dt_min), min(float(dt_max), torch.finfo(torch.float32).max),
        dt.stride(0), dt.stride(1),
        delta.stride(0), delta.stride(1), chunk_decay.stride(0),
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, HAS_DT_LIMIT=has_dt_limit,
        CUMSUM_FP64=not rounded, BLOCK_C=blocks.c, BLOCK_Q=blocks.q, BLOCK_H=blocks.h_cumsum,
    )

    states = torch.empty(n_chunks, n_heads, head_dim, d_state, **f32)                    # (NC, H, P, N)
    heads_per_group = n_heads // n_groups
    tiles = blocks.c == 1 and blocks.h == 1          # the GPU's launch: 2-D tiles, one chunk and head a program
    # what both forms of stage 2 take (the batched one also the chunk and head counts, which it cuts into blocks)
    operands = (x, B, delta, dA_cumsum, states, chunk_start, chunk_len)
    strides = (x.stride(0), x.stride(1), x.stride(2),
               B.stride(0), B.stride(1), B.stride(2),
               delta.stride(0), delta.stride(1),
               states.stride(0), states.stride(1), states.stride(2), states.stride(3))
    launch = dict(HOW_XB=how_xb, BLOCK_K=blocks.m, BLOCK_P=blocks.p, BLOCK_N=blocks.n_state, num_warps=blocks.warps,
                  num_stages=blocks.stages, **registers)
    state_tiles = cdiv(head_dim, blocks.p) * cdiv(d_state, blocks.n_state)
    if tiles:
        _ssd_chunk_state_tile_kernel[(n_heads, n_chunks, state_tiles)](
            *operands, head_dim, d_state, heads_per_group, *strides, **launch)
    else:
        _ssd_chunk_state_fwd_kernel[(head_blocks, chunk_blocks, state_tiles)](
            *operands, n_chunks, n_heads, head_dim, d_state, heads_per_group, *strides,
            BLOCK_C=blocks.c, BLOCK_H=blocks.h, **launch)

    # the states entering the chunks: in place over the chunks' own (fp32), or rounded to C's 16-bit dtype once here
    # rather than in every stage-4 program that reads them (products="rounded")
    states_in = (torch.empty(states.shape, dtype=C.dtype, device=x.device) if rounded and C.dtype in half
                 else states)
    _ssd_state_passing_fwd_kernel[(n_seqs, head_blocks,
                                   cdiv(head_dim, blocks.p) * cdiv(d_state, blocks.n_pass))](
        states, states_in, chunk_decay, seq_chunks,
        ssm_states, state_indices,
        has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state,
        n_heads, head_dim, d_state, ssm_states.shape[0],
        chunk_decay.stride(0),
        states.stride(0), states.stride(1), states.stride(2), states.stride(3),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), ssm_states.stride(3),
        BLOCK_H=blocks.h, BLOCK_P=blocks.p, BLOCK_N=blocks.n_pass, ROUND_BY_BITS=interpreted(),
    )

    cb = torch.empty(n_chunks, n_groups, blocks.q, blocks.q, **f32)                     # (NC, G, Q, Q)
    group_blocks = cdiv(n_groups, blocks.h)
    _ssd_bmm_chunk_fwd_kernel[(group_blocks, chunk_blocks * m_blocks * m_blocks)](
        B, C, cb, chunk_start, chunk_len,
        n_chunks, n_groups, d_state,
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        cb.stride(0), cb.stride(1), cb.stride(2),
        HOW_CB=how_cb, M_BLOCKS=m_blocks, BLOCK_C=blocks.c, BLOCK_G=blocks.h, BLOCK_M=blocks.m,
        BLOCK_N=blocks.n_scan, num_warps=blocks.warps, num_stages=blocks.stages,
    )

    # stage 4's own tile and launch (0: the shared fields); the sweep varies them without touching the other stages
    scan_m, scan_p = blocks.scan_m or blocks.m, blocks.scan_p or blocks.p
    if scan_m > blocks.m:
        raise ValueError(f"stage 4's rows ({scan_m}) exceed the C·Bᵀ tile ({blocks.m}): "
                         "it would read tiles that were not written")
    scan_m_blocks = blocks.q // scan_m
    scan_k = blocks.scan_k or scan_m
    operands = (x, z if z is not None else x, C, cb, D if D is not None else A, delta, dA_cumsum, states_in, y,
                chunk_start, chunk_len)
    strides = (x.stride(0), x.stride(1), x.stride(2),
               *(z.stride() if z is not None else (0, 0, 0)),
               C.stride(0), C.stride(1), C.stride(2),
               cb.stride(0), cb.stride(1), cb.stride(2),
               delta.stride(0), delta.stride(1),
               states.stride(0), states.stride(1), states.stride(2), states.stride(3),
               y.stride(0), y.stride(1), y.stride(2))
    launch = dict(HAS_D=D is not None, HAS_Z=z is not None, HOW_CS=how_cs, HOW_X=how_x, M_BLOCKS=scan_m_blocks,
                  BLOCK_M=scan_m, BLOCK_K=scan_k, BLOCK_P=scan_p, BLOCK_N=blocks.n_scan,
                  num_warps=blocks.scan_warps or blocks.warps, num_stages=blocks.scan_stages or blocks.stages,
                  **scan_registers)
    # (an fp32 x on the GPU, whose products run as fp32 FMAs, keeps the batched kernel: the tile kernel's three
    # product loops spill there, 16-24 bytes, at any column step)
    if tiles and not (on_gpu and how_x == 3):
        if scan_m % scan_k:
            raise ValueError(f"stage 4's column step ({scan_k}) does not divide its rows ({scan_m})")
        _ssd_chunk_scan_tile_kernel[(n_heads, n_chunks * scan_m_blocks, cdiv(head_dim, scan_p))](
            *operands, head_dim, d_state, heads_per_group, *strides, **launch)
    else:
        _ssd_chunk_scan_fwd_kernel[(head_blocks, chunk_blocks * scan_m_blocks, cdiv(head_dim, scan_p))](
            *operands, n_chunks, n_heads, head_dim, d_state, heads_per_group, *strides,
            BLOCK_C=blocks.c, BLOCK_H=blocks.h, **launch)
    check()
    return y
