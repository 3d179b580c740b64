#!/bin/bash
source .venv/bin/activate; export OMP_NUM_THREADS=1
for s in $(seq 0 19); do
  python -m harness.cli compare --engine transformers --checkpoint fixtures/deep-bamba --dtype bfloat16 \
    --budget-rule max --allow-skips --prompts random --seed $s \
    --scenarios batching-together,batching-long-decode --out out/tf-deep-z/seed$s > out/tf-deep-z/seed$s.log 2>&1
  echo "seed $s rc $?" >> out/tf-deep-z/done.txt
done
