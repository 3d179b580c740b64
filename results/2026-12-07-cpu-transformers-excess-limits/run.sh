#!/bin/bash
# transformers' BambaForCausalLM in bf16 on the CPU against the fp64 oracle: the two default scale scenarios it runs
# without a scheduler, prompt seeds FIRST..LAST, on one model:
#   deep-bamba | tiny-bamba (the trained fixtures) | deep-bamba-random | tiny-bamba-random (their shapes with weights
#   drawn by the zoo's scheme, seed 0, written under out/ on first use)
# usage: run.sh MODEL FIRST LAST   (from anywhere; writes out/tf-limits/MODEL/seedS/report.json)
set -u
cd "$(dirname "$0")/../.."
source .venv/bin/activate; export OMP_NUM_THREADS=1
MODEL=$1; OUT=out/tf-limits/$MODEL; mkdir -p "$OUT"
case $MODEL in
  *-random) CKPT=out/tf-limits/checkpoints/$MODEL
            [ -f "$CKPT/config.json" ] || python -c "from pathlib import Path; from harness.measure_noise import random_twin; \
random_twin(Path('fixtures/${MODEL%-random}'), Path('$CKPT'))" ;;
  *) CKPT=fixtures/$MODEL ;;
esac
# mamba_n_groups 2: transformers 5.17 normalises the gated RMSNorm over all channels (the oracle's --gated-norm full)
EXTRA=""; grep -q '"mamba_n_groups": 1,' "$CKPT/config.json" || EXTRA="--gated-norm full"
for s in $(seq "$2" "$3"); do
  python -m harness.cli compare --engine transformers --checkpoint "$CKPT" --dtype bfloat16 --budget-rule max \
    --allow-skips $EXTRA --prompts random --seed "$s" --scenarios batching-together,batching-long-decode \
    --out "$OUT/seed$s" > "$OUT/seed$s.log" 2>&1
  echo "seed $s rc $? $(date -u +%T)" >> "$OUT/done.txt"
done
