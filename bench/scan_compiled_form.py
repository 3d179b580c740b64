"""What the SSD scan's product kernels compile to on Hopper, without a GPU: for each, the registers and spills
ptxas reports for sm_90a and how its tiles move through shared memory (TTGIR ops and PTX instructions).

    .venv/bin/python -m bench.scan_compiled_form [--products rounded] [--dump DIR]   # CPU is enough, ~1 minute

The scan is called once as the engine calls it (bf16 x, B, C; fp32 state pool; D and dt_bias; Bamba-9B widths)
under vendored/ops/_compile_check.py's launch catcher, and its stage-2 and stage-4 launches are compiled for sm_90.
The numbers to read: `local_alloc` / `local_load` pairs are tiles written to shared memory and read back in the
layout a product wants (a register operand that could not go to wgmma directly); `wgmma` the tensor-core products.
--dump writes each kernel's TTGIR and PTX for a closer look.
"""

from __future__ import annotations

import argparse
import os

import torch

from vendored.ops import _compile_check as cc
from vendored.ops import ssd_scan

TTGIR_OPS = ("ttg.local_alloc", "ttg.local_load", "ttg.convert_layout", "tt.reshape", "ttng.warp_group_dot ")
PTX_OPS = ("st.shared", "ld.shared", "ldmatrix", "bar.sync", "ex2.approx")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.scan_compiled_form", description=__doc__.split("\n\n")[0])
    p.add_argument("--dump", default=None, help="folder for each kernel's .ttgir and .ptx")
    p.add_argument("--products", default="fp32", choices=("fp32", "rounded"), help="ssd_scan's precision mode")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    catcher = cc.LaunchCatcher()
    H, P, N, G, Q = cc.H, cc.P, cc.N, cc.G, cc.Q
    with catcher.active():
        catcher.label("bfloat16, float32 pool, as the engine calls it")
        bf16 = lambda *shape: torch.randn(*shape).to(torch.bfloat16)                 # noqa: E731
        index = lambda *values: torch.tensor(values, dtype=torch.int32)              # noqa: E731
        ssd_scan(bf16(9, H, P), bf16(9, H), -torch.rand(H), bf16(9, G, N), bf16(9, G, N), chunk_size=Q,
                 D=torch.randn(H), dt_bias=torch.randn(H), z=None, cu_seqlens=index(0, 4, 9),
                 ssm_states=torch.randn(5, H, P, N), state_indices=index(1, 3),
                 has_initial_state=torch.tensor([True, False]), products=a.products)
    for launch in catcher.launches:
        name = launch.kernel.fn.__name__
        if name not in cc.TENSOR_CORE_KERNELS:
            continue
        compiled = cc.compile_for_gpu(launch)[1]()
        ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            for ext, text in (("ttgir", ttgir), ("ptx", ptx)):
                with open(os.path.join(a.dump, f"{name}.{ext}"), "w") as f:
                    f.write(text)
        report = cc.ptxas_report(ptx)
        print(f"{name}: {report.registers} registers, {report.spilled} B spilled")
        print("  TTGIR " + ", ".join(f"{op.strip()} {ttgir.count(op)}" for op in TTGIR_OPS))
        print("  PTX   " + ", ".join(f"{op} {ptx.count(op)}" for op in PTX_OPS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
