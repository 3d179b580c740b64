"""Compile every kernel of vendored/ops ahead of time for Hopper (sm_90), on a machine without a GPU.

    python -m vendored.ops._compile_check

The CPU test suite runs the kernels in the Triton interpreter, which never compiles them; this check covers the
other half of a change made on a CPU machine: the GPU code paths still build. Each op's host function is called on
small CPU tensors at Bamba-9B's widths (H=128, P=64, N=128, G=1, Q=256, C=8448; the scan also at the test models'
widths, whose tiles are too small for wgmma), in bf16 and fp32, with the launch
parameters it chooses for a CUDA device (its `_block_sizes(..., device)`, or each function its LAUNCH_CHOOSERS
names, is handed torch.device("cuda")). Every launch is caught instead of run, specialised as the JIT specialises
it on the GPU (pointer dtypes, integers equal to 1, 16-byte divisibility), and compiled down to a cubin by the
ptxas that ships in triton's wheel. One line per distinct compilation, with what ptxas reports (registers, bytes
spilled) and which tensor-core instructions the PTX holds (wgmma: Hopper's; mma.sync: the older kind). The exit
status is 1 if any failed, spilled registers (in a launch the op chooses by default), or if a product kernel of
the scan (TENSOR_CORE_KERNELS) ran its 16-bit products anywhere but on wgmma: the speed of those kernels depends
on it, and a change of tile shape or rank silently gives it up (a 3-D tl.dot lowers to mma.sync with kilobytes of
spills, as the scan did before 2026-11-30).

It leans on two internals of triton 3.6's JIT (`create_function_from_signature`, `JITFunction._pack_args`), the
same calls `JITFunction.run` makes before it compiles.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import re
import subprocess
import sys
import tempfile
import traceback
from typing import Callable, Iterator, NamedTuple

from triton import knobs

if knobs.runtime.interpret:
    # The kernels would be defined as interpreted functions, which cannot be compiled: start again without it.
    os.execve(sys.executable, [sys.executable, "-m", "vendored.ops._compile_check", *sys.argv[1:]],
              {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler import compile as compile_triton  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)                                 # H100 / H200, warp size 32
# A case label ending so is a launch the op does not choose by default (a sweep's candidate): it must compile, but
# may spill.
ALTERNATIVE = "(alternative launch)"
# A case label ending so has tiles too small for wgmma (it needs 64 rows): its products may run on mma.sync.
SMALL_TILES = "(small tiles)"
# Spill bytes allowed to a launch that caps its registers (see problems_of).
CAPPED_SPILL_BYTES = 32
# Kernels whose products of 16-bit inputs must run on Hopper's wgmma (checked on the bf16 calls).
TENSOR_CORE_KERNELS = ("_ssd_chunk_state_fwd_kernel", "_ssd_bmm_chunk_fwd_kernel", "_ssd_chunk_scan_fwd_kernel",
                       "_ssd_chunk_scan_tile_kernel", "_ssd_chunk_state_tile_kernel")
# The modules that hold each op's host function and launch choosers, and import the kernels it launches (the scan's
# and the convs' kernels are in modules of their own: vendored/ops/ssd_scan_kernels.py, ssd_scan_tiles.py, causal_conv1d_kernels.py).
OP_MODULES = [importlib.import_module(f"vendored.ops.{name}")
              for name in ("causal_conv1d", "decode_attention", "rms_norm", "rms_norm_gated", "rotary",
                           "selective_state_update", "silu_mul", "ssd_scan")]

# Bamba-9B's mixer widths; a few tokens are enough, the compiled code does not depend on how many.
H, P, N, G, W, Q = 128, 64, 128, 1, 4, 256
CONV_CHANNELS = H * P + 2 * G * N


class Launch(NamedTuple):
    """One caught kernel launch, and the call of an op that made it."""
    kernel: JITFunction
    args: tuple
    kwargs: dict
    case: str


class LaunchCatcher:
    """While active, host functions choose the launch parameters of a CUDA device, and every kernel launch is
    recorded in `launches` (under the name last given to `label`) instead of being run."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.case = ""

    def label(self, case: str) -> None:
        self.case = case

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved = []
        for module in OP_MODULES:
            for chooser in getattr(module, "LAUNCH_CHOOSERS", ("_block_sizes",)):
                choose = getattr(module, chooser)
                saved.append((module, chooser, choose))
                setattr(module, chooser, lambda *args, _choose=choose: _choose(*args[:-1], torch.device("cuda")))
            for kernel in vars(module).values():
                # a jit helper imported by several modules (round_to) is patched once
                if isinstance(kernel, JITFunction) and all(kernel is not owner for owner, _, _ in saved):
                    saved.append((kernel, "run", None))      # an instance attribute shadowing JITFunction.run
                    kernel.run = (lambda *args, grid, warmup, _kernel=kernel, **kwargs:
                                  self.launches.append(Launch(_kernel, args, kwargs, self.case)))
        try:
            yield
        finally:
            for owner, name, value in saved:
                if value is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, value)


def call_every_op(dtype: torch.dtype, label: Callable[[str], None]) -> None:
    """Call every op in `dtype`, with all optional inputs and with none of them; `label` names each call first."""
    from vendored.ops import (add_rms_norm, causal_conv1d, causal_conv1d_update, rms_norm_gated, rotary_,
                              selective_state_update, silu_mul, ssd_scan)
    from vendored.ops.decode_attention import decode_attention

    def randn(*shape, dt=dtype):
        return torch.randn(*shape).to(dt)

    def index(*values):
        return torch.tensor(values, dtype=torch.int32)

    # the decoder layer's own ops at Bamba-9B's widths: D 4096, MLP 14336, 32 q + 8 kv heads of 128, R 64
    for delta in (True, False):
        label(f"add_rms_norm, {'with' if delta else 'without'} a residual")
        add_rms_norm(randn(3, 4096), randn(3, 4096) if delta else None, randn(4096), eps=1e-5)
    label("silu_mul")
    silu_mul(randn(3, 2 * 14336))
    label("rotary_, q and k of a merged q/k/v")
    angles = torch.randn(64, 64)
    rotary_(randn(3, 48, 128), index(0, 5, 63), angles.cos(), angles.sin(), n_rot_heads=40)
    # the CUDA-graph step's decode attention: q the first 32 heads of a merged q/k/v, blocks of 16, a table of 256
    # blocks (4096 keys). One row: 16 splits and the combine; 256 rows: one split, the output written directly.
    for rows, tables in ((1, torch.zeros(1, 256, dtype=torch.long)), (256, torch.zeros(256, 256, dtype=torch.long)),
                         (8, torch.zeros(8, 256, dtype=torch.int32))):
        label(f"decode_attention, {rows} rows, {str(tables.dtype).removeprefix('torch.')} table")
        decode_attention(randn(rows, 48, 128)[:, :32], randn(64 * 16, 8, 128), randn(64 * 16, 8, 128), tables,
                         torch.zeros(rows, dtype=torch.long), block_size=16, scale=128 ** -0.5)
    label("decode_attention, head dim 48 (padded to 64), 4 q heads a kv head of 2, blocks of 3")
    decode_attention(randn(2, 8, 48), randn(30, 2, 48), randn(30, 2, 48), torch.zeros(2, 400, dtype=torch.long),
                     index(5, 0), block_size=3, scale=0.1)

    for group_size in (H * P, H * P // 8):
        for norm_before_gate in (False, True):
            label(f"rms_norm_gated, group {group_size}, norm_before_gate={norm_before_gate}")
            rms_norm_gated(randn(5, H * P), randn(5, H * P), randn(H * P), eps=1e-5, group_size=group_size,
                           norm_before_gate=norm_before_gate)
    label("rms_norm_gated, no gate")
    rms_norm_gated(randn(5, H * P), None, randn(H * P), eps=1e-5, group_size=H * P)
    label("rms_norm_gated, group 2·H·P (wider than one piece: two passes)")
    rms_norm_gated(randn(5, 2 * H * P), randn(5, 2 * H * P), randn(2 * H * P), eps=1e-5, group_size=2 * H * P)

    C = CONV_CHANNELS
    for bias, activation, what in ((randn(C), "silu", "bias, silu"), (None, None, "no bias, no activation")):
        label(f"causal_conv1d, {what}")
        causal_conv1d(randn(7, C), randn(C, W), bias, randn(4, C, W - 1), index(0, 2, 7), index(1, 3),
                      torch.tensor([True, False]), activation=activation)
        label(f"causal_conv1d_update, {what}")
        causal_conv1d_update(randn(3, C), randn(4, C, W - 1), randn(C, W), bias, index(1, -1, 2),
                             activation=activation)
    label("causal_conv1d, one sequence")                              # n_seqs == 1 is specialised: no search
    causal_conv1d(randn(7, C), randn(C, W), randn(C), randn(4, C, W - 1), index(0, 7), index(2), torch.tensor([True]))
    # the channel-last pool (S, W-1, C) seen as (S, C, W-1), vLLM's layout and the benchmark's: other strides
    label("causal_conv1d, channel-last pool")
    causal_conv1d(randn(7, C), randn(C, W), randn(C), randn(4, W - 1, C).transpose(1, 2), index(0, 2, 7), index(1, 3),
                  torch.tensor([True, False]))
    label("causal_conv1d_update, channel-last pool")
    causal_conv1d_update(randn(3, C), randn(4, W - 1, C).transpose(1, 2), randn(C, W), randn(C), index(1, -1, 2))
    # the other prefill kernel, a launch choice bench/sweep_conv.py times: 2-D tiles (rows_per_step = 0)
    conv_module = importlib.import_module("vendored.ops.causal_conv1d")
    choose = conv_module._prefill_launch
    conv_module._prefill_launch = lambda *args: choose(*args)._replace(rows_per_step=0, block_t=32, num_warps=4)
    try:
        for cl_pool in (False, True):
            label(f"causal_conv1d, 2-D tiles{', channel-last pool' if cl_pool else ''} {ALTERNATIVE}")
            pool = randn(4, W - 1, C).transpose(1, 2) if cl_pool else randn(4, C, W - 1)
            causal_conv1d(randn(7, C), randn(C, W), randn(C), pool, index(0, 2, 7), index(1, 3),
                          torch.tensor([True, False]))
        label(f"causal_conv1d, 2-D tiles, one sequence {ALTERNATIVE}")
        causal_conv1d(randn(7, C), randn(C, W), randn(C), randn(4, C, W - 1), index(0, 7), index(2),
                      torch.tensor([True]))
    finally:
        conv_module._prefill_launch = choose
    for rows in (64, 256):                                             # the row tiles of larger batches
        label(f"causal_conv1d_update, {rows} rows")
        causal_conv1d_update(randn(rows, C), randn(rows, W - 1, C).transpose(1, 2), randn(C, W), randn(C),
                             torch.arange(rows, dtype=torch.int32))

    for state_dtype in (torch.float32, torch.bfloat16):
        pool = f"{str(state_dtype).removeprefix('torch.')} pool"
        # x, B, C as column views of one projection row, as the engine passes them
        xs, Bs, Cs = randn(3, H * P + 2 * G * N).split([H * P, G * N, G * N], dim=-1)
        label(f"selective_state_update, {pool}, all inputs, dt_limit")
        selective_state_update(randn(4, H, P, N, dt=state_dtype), xs.reshape(3, H, P), randn(3, H), -torch.rand(H),
                               Bs.reshape(3, G, N), Cs.reshape(3, G, N), D=torch.randn(H), dt_bias=torch.randn(H),
                               z=randn(3, H, P), state_indices=index(2, -1, 0), dt_limit=(0.0, 10.0))
        label(f"selective_state_update, {pool}, 16 rows (a larger batch's launch)")
        selective_state_update(randn(17, H, P, N, dt=state_dtype), randn(16, H, P), randn(16, H), -torch.rand(H),
                               randn(16, G, N), randn(16, G, N), D=torch.randn(H), dt_bias=torch.randn(H), z=None,
                               state_indices=torch.arange(16, dtype=torch.int32))
        label(f"selective_state_update, {pool}, one row, no optional inputs")
        selective_state_update(randn(4, H, P, N, dt=state_dtype), randn(1, H, P), randn(1, H), -torch.rand(H),
                               randn(1, G, N), randn(1, G, N), D=None, dt_bias=None, z=None,
                               state_indices=index(3), dt_softplus=False)
        for what, full, has_z in (("all inputs, dt_limit", True, True), ("no optional inputs", False, False),
                                  ("D and dt_bias, no z (as the engine calls it)", True, False)):
            label(f"ssd_scan, {pool}, {what}")
            ssd_scan(randn(9, H, P), randn(9, H), -torch.rand(H), randn(9, G, N), randn(9, G, N), chunk_size=Q,
                     D=torch.randn(H) if full else None, dt_bias=torch.randn(H) if full else None,
                     z=randn(9, H, P) if has_z else None, cu_seqlens=index(0, 4, 9),
                     ssm_states=randn(5, H, P, N, dt=state_dtype), state_indices=index(1, 3),
                     has_initial_state=torch.tensor([True, False]), dt_softplus=full,
                     dt_limit=(0.0, 10.0) if full and has_z else (0.0, math.inf))
        label(f"ssd_scan, {pool}, products=rounded, all inputs")
        ssd_scan(randn(9, H, P), randn(9, H), -torch.rand(H), randn(9, G, N), randn(9, G, N), chunk_size=Q,
                 D=torch.randn(H), dt_bias=torch.randn(H), z=randn(9, H, P), cu_seqlens=index(0, 4, 9),
                 ssm_states=randn(5, H, P, N, dt=state_dtype), state_indices=index(1, 3),
                 has_initial_state=torch.tensor([True, False]), products="rounded")
        # the test models' widths (tests/helpers.py TINY_CONFIG: H=4, P=16, N=8, G=2, Q=8), one sequence shorter than
        # a chunk: small tiles that once failed to compile (stage 1 with 4 heads per program)
        label(f"ssd_scan, {pool}, test-model widths, one short sequence {SMALL_TILES}")
        ssd_scan(randn(5, 4, 16), randn(5, 4), -torch.rand(4), randn(5, 2, 8), randn(5, 2, 8), chunk_size=8,
                 D=torch.randn(4), dt_bias=torch.randn(4), z=randn(5, 4, 16), cu_seqlens=index(0, 5),
                 ssm_states=randn(3, 4, 16, 8, dt=state_dtype), state_indices=index(1),
                 has_initial_state=torch.tensor([True]))


def compile_for_gpu(launch: Launch):
    """What JITFunction.run does before it compiles, for TARGET rather than the current device."""
    kwargs = dict(launch.kwargs, debug=launch.kwargs.get("debug", launch.kernel.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    backend = make_backend(TARGET)
    binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    key = (launch.kernel.fn.__qualname__, str(specialization), str(options))
    options, signature, constexprs, attrs = launch.kernel._pack_args(backend, kwargs, bound_args, specialization,
                                                                     options)
    return key, lambda: compile_triton(ASTSource(launch.kernel, signature, constexprs, attrs), target=TARGET,
                                       options=options.__dict__)


class Report(NamedTuple):
    registers: int
    spilled: int           # bytes of spill stores
    wgmma: int             # wgmma.mma_async instructions in the PTX
    mma_sync: int          # mma.sync instructions


def ptxas_report(ptx: str) -> Report:
    """Registers and spills as ptxas reports them for sm_90a, and the tensor-core instructions of the PTX."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        info = subprocess.run([get_ptxas(TARGET.arch).path, "-v", "--gpu-name=sm_90a", path, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    return Report(int(registers.group(1)) if registers else -1, int(spills.group(1)) if spills else 0,
                  ptx.count("wgmma.mma_async"), ptx.count("mma.sync"))


def problems_of(name: str, case: str, report: Report, capped: bool = False) -> list[str]:
    """capped: the launch caps its registers (maxnreg), trading a few spilled words for more programs an SM; up to
    CAPPED_SPILL_BYTES of spills are that trade (ptxas moves a value or two out), more is a launch to fix."""
    found = []
    if report.spilled > (CAPPED_SPILL_BYTES if capped else 0) and not case.endswith(ALTERNATIVE):
        found.append(f"spills {report.spilled} bytes of registers" + (" under its register cap" if capped else ""))
    if (name in TENSOR_CORE_KERNELS and case.startswith("bfloat16") and not case.endswith(SMALL_TILES)
            and (report.mma_sync or not report.wgmma)):
        found.append(f"runs its products on {report.mma_sync} mma.sync / {report.wgmma} wgmma instructions, "
                     "not on wgmma alone")
    return found


def main() -> int:
    torch.manual_seed(0)
    catcher = LaunchCatcher()
    with catcher.active():
        for dtype in (torch.bfloat16, torch.float32):
            short = str(dtype).removeprefix("torch.")
            call_every_op(dtype, lambda case, short=short: catcher.label(f"{short}: {case}"))
    done, failed = set(), 0
    for launch in catcher.launches:
        key, build = compile_for_gpu(launch)
        if key in done:
            continue
        done.add(key)
        name = launch.kernel.fn.__name__
        try:
            compiled = build()
        except Exception:                                           # report every failure, not just the first
            failed += 1
            print(f"FAIL {name}  [{launch.case}]\n{traceback.format_exc()}", flush=True)
            continue
        meta = compiled.metadata
        report = ptxas_report(compiled.asm["ptx"])
        line = (f"{name}  [{launch.case}]  {meta.num_warps} warps, {meta.shared} B shared, {report.registers} "
                f"registers, {report.spilled} B spilled, {report.wgmma} wgmma, {report.mma_sync} mma.sync")
        problems = problems_of(name, launch.case, report, capped="maxnreg" in launch.kwargs)
        if problems:
            failed += 1
            print(f"FAIL {line}: {'; '.join(problems)}", flush=True)
            continue
        print(f"OK   {line}", flush=True)
    print(f"{len(done) - failed} of {len(done)} distinct kernel specialisations compiled for sm_{TARGET.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
