#!/bin/bash
# Device call U (issue 24): selective_state_update launch candidates beside vLLM (fp32 state at batch 1 and 8).
cd "$(dirname "$0")/.."
mkdir -p $OUT/u; S=$(date +%s)
timeout 300 python3 -m bench.sweep_norm_ssu --peers .peers --only selective_state_update --rounds 5 --budget 200 --out $OUT/u/sweep_ssu.json > $OUT/u/sweep_ssu.txt 2>&1; echo "rc=$? $(( $(date +%s) - S )) s" >> $OUT/u/sweep_ssu.txt
