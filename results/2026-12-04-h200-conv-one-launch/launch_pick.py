"""Device time (profiler) and do_bench of causal_conv1d launch candidates beside vLLM, interleaved, 3 rounds."""
import importlib, json, sys
import torch, triton, triton.testing
importlib.import_module("torch._inductor")
from bench.kernel_cases import BAMBA_9B, Setup, conv_case
from bench.kernels import load_peers
from bench.latency import gpu_us
from vendored.ops.causal_conv1d import PrefillLaunch
conv = importlib.import_module("vendored.ops.causal_conv1d")
default = conv._prefill_launch
def cand(t, c, w, r):
    return PrefillLaunch(block_t=t, block_c=c, num_warps=w, channels_fastest=True, rows_per_step=r,
                         state_block_b=1, state_block_c=256, pdl=True)
C = {"default": None, "13,128,1,8": cand(13, 128, 1, 8), "13,256,2,8": cand(13, 256, 2, 8),
     "29,128,1,8": cand(29, 128, 1, 8), "29,256,2,4": cand(29, 256, 2, 4), "61,256,1,8": cand(61, 256, 1, 8),
     "125,256,1,8": cand(125, 256, 1, 8)}
setup = Setup(BAMBA_9B, torch.device("cuda"), torch.bfloat16, 0)
peers = load_peers(sys.argv[1], print)
rows = []
for rnd in range(3):
    for T, B in ((2048, 8), (2048, 1), (32768, 8), (32768, 1)):
        impls = conv_case(setup, peers, T, B).build()
        for name, choice in C.items():
            conv._prefill_launch = default if choice is None else (lambda *a, _c=choice: _c)
            run, _ = impls["ours"].prepare(); run(); torch.cuda.synchronize()
            g, ev = gpu_us(run, 50)
            b = triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median") * 1e3
            rows.append(dict(round=rnd, case=f"T{T}-seqs{B}", impl=name, gpu_us=g, events=ev, bench_us=b))
            print(rows[-1], flush=True)
        conv._prefill_launch = default
        run, _ = impls["vllm"].prepare(); run(); torch.cuda.synchronize()
        g, ev = gpu_us(run, 50)
        b = triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median") * 1e3
        rows.append(dict(round=rnd, case=f"T{T}-seqs{B}", impl="vllm", gpu_us=g, events=ev, bench_us=b))
        print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[2], "w"), indent=1)
