"""Finding: vLLM 0.7.3's Mamba2 scan (the first release that served Bamba) gives a wrong y to every sequence that
starts inside a chunk of the packed batch and continues from an initial state (a chunked prefill's later piece).

Its `mamba_chunk_scan_combined` cuts the packed token axis into chunks of Q from token 0 and marks sequence starts by
seq_idx; a sequence that begins mid-chunk does not start from its own initial state (one that begins mid-chunk
without one, or at a chunk start with one, is right). That is the chunked-prefill
bug the Bamba PR described ("works only when the cont batch boundaries line up with the chunked boundaries"); 0.10.2
passes the chunk_indices/chunk_offsets of its V1 metadata (logical chunks split at sequence starts) and is right, and
so is 0.33.0. Measured under the Triton interpreter in fp32 (H=4, P=16, N=16, G=2, Q=16), sequences of 5, 20, 9, 30,
7 tokens with initial states where b % 3 != 2, called as 0.7.3's Mamba2 mixer calls it: y of sequences 1 (starts at
offset 5 of chunk 0) and 3 (offset 2 of chunk 2) off by up to 0.78 and 0.22 against the fp64 twin, the others within
2.2e-6; the test's tolerance there is about 1e-4 (tests/kernels/test_ssd_scan.py, whose seeds give up to 1.47). On the H200 in bf16 at Bamba-9B widths the same holds
(docs/kernel-conformance.md).

Reproduce (`make fetch-peers` first; exit status 1 while the finding holds):

    .venv/bin/python findings/vllm_073_scan_initial_state_mid_chunk.py
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    import torch
    from reference.ops import ssd_scan_ref
    from tests.kernels.providers import make

    ops = make("vllm-0.7.3")
    gen = torch.Generator().manual_seed(0)
    lengths, H, P, N, G, Q = (5, 20, 9, 30, 7), 4, 16, 16, 2, 16
    T = sum(lengths)
    x, z = torch.randn(T, H, P, generator=gen), None
    B, C = torch.randn(T, G, N, generator=gen), torch.randn(T, G, N, generator=gen)
    dt, dt_bias = 0.5 * torch.randn(T, H, generator=gen), torch.rand(H, generator=gen) * 2 - 3
    A, D = -(0.5 + 3.5 * torch.rand(H, generator=gen)), torch.randn(H, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.arange(len(lengths), dtype=torch.int32)
    initial = torch.tensor([b % 3 != 2 for b in range(len(lengths))])
    pool = torch.randn(len(lengths), H, P, N, generator=gen)
    kwargs = dict(chunk_size=Q, D=D, dt_bias=dt_bias, z=z, cu_seqlens=cu, state_indices=slots,
                  has_initial_state=initial)
    y = ops.ssd_scan(x, dt, A, B, C, ssm_states=pool.clone(), **kwargs)
    y64 = ssd_scan_ref(x.double(), dt.double(), A.double(), B.double(), C.double(), ssm_states=pool.double(),
                       **{**kwargs, "D": D.double(), "dt_bias": dt_bias.double()})
    worst = 0.0
    for b, (start, stop) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        err = float((y[start:stop].double() - y64[start:stop]).abs().max())
        worst = max(worst, err)
        where = "at a chunk start" if start % Q == 0 else f"inside chunk {start // Q} (offset {start % Q})"
        print(f"sequence {b}: tokens {start}..{stop - 1}, starts {where}, initial state {bool(initial[b])}: "
              f"max |y - y_fp64| = {err:.3g}")
    print(f"vllm 0.7.3: worst {worst:.3g}; the kernel tests' fp32 tolerance here is about 1e-4")
    return 1 if worst > 1e-3 else 0


if __name__ == "__main__":
    sys.exit(main())
