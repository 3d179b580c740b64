#!/bin/bash
# seeds $1..$2 of transformers bf16 on deep-bamba, the default scenarios at Q=16, both budget rules
source .venv/bin/activate
export OMP_NUM_THREADS=1
for s in $(seq $1 $2); do
  python -m harness.cli compare --engine transformers --checkpoint fixtures/deep-bamba --dtype bfloat16 \
    --budget-rule quantile,max --allow-skips --prompts random --seed $s \
    --scenarios chunked_prefill-capped-budget40-cap16-Q16,cudagraph-on,batching-together,chunked_prefill-budget17-Q16,preemption-blocks7x8-Q16,chunked_prefill-budget3-Q16,batching-long-decode,sampled-long-decode-T2 \
    --out out/tf-deep/seed$s > out/tf-deep/seed$s.log 2>&1
  echo "seed $s rc $?" >> out/tf-deep/done.txt
done
