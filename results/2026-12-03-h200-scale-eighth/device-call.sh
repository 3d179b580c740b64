#!/bin/bash
# Device call F (issue 21): the bf16 and fp32 mutant tables on the current engine, resumable (DIR carried as
# scratch/ms-both between calls, the oracle cache included).
cd "$(dirname "$0")/.."
W=$(mktemp -d); S=$(date +%s)
LIMIT=${1:-500}
mkdir -p "$W/ms"; [ -d scratch/ms-both ] && cp -r scratch/ms-both/. "$W/ms/"
pack() { tar czf "$OUT/r.tgz" -C "$W" . ; }
stamp() { echo "$1 $(( $(date +%s) - S )) s since start" >> "$W/times.txt"; pack; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$W/smi.txt"
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> "$W/smi.txt"
git log --oneline -1 >> "$W/smi.txt"; git status --short >> "$W/smi.txt"
stamp start
timeout 60 python3 -m harness.cli write-model bamba9b-2layer /tmp/b9b-2 --device cuda > "$W/write.log" 2>&1; stamp "write rc=$?"
( while sleep 20; do pack; done ) & P=$!
( while sleep 15; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader >> "$W/smi-trace.txt"; done ) & Q=$!
timeout $((LIMIT + 40)) python3 -m mutants.scale --resume --out "$W/ms" --model-dir /tmp/b9b-2 --dtypes bfloat16,float32 \
  --clean-seeds 20 --clean-procs 3 --jobs 8 --time-limit $LIMIT > "$W/ms/call-$(date +%H%M).log" 2>&1
stamp "mutants.scale rc=$?"
kill $P $Q; pack
