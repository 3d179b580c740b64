#!/bin/bash
# Device call C2 (issue 24): the one-launch conv prefill with its final launch choice: make test-gpu, then
# causal_conv1d against vLLM (bench.kernels, bench.latency), then make mutants-gpu.
cd "$(dirname "$0")/.."
S=$(date +%s); W=$(mktemp -d); R=$W/c2; mkdir -p $R
stamp() { echo "$1 $(( $(date +%s) - S )) s since start" >> $R/times.txt; tar czf $OUT/c2.tgz -C $W c2; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > $R/smi.txt
python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" >> $R/smi.txt
stamp start
timeout 200 make test-gpu GPU_PY=python3 > $R/test-gpu.log 2>&1; stamp "test-gpu rc=$?"
timeout 120 python3 -m bench.kernels --peers .peers --only causal_conv1d --out $R/bench > $R/bench.log 2>&1; stamp "bench.kernels rc=$?"
timeout 90 python3 -m bench.latency --peers .peers --only causal_conv1d --out $R/latency > $R/latency.log 2>&1; stamp "bench.latency rc=$?"
timeout 150 make mutants-gpu GPU_PY=python3 > $R/mutants-gpu.log 2>&1; stamp "mutants-gpu rc=$?"
