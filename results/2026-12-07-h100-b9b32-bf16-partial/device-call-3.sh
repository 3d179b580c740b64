#!/bin/bash
# bamba9b-32layer through mutants.scale, bf16 then fp32, resumable across calls while the machine stays warm
# (model and out dir under scratch/, which is ignored and kept between calls).
cd "$(dirname "$0")/.."
S=$(date +%s); TOTAL=${1:-570}
M=/tmp/b9b-32; O=scratch/b9b32-ms; mkdir -p "$O" "$OUT"
left() { echo $(( TOTAL - ($(date +%s) - S) )); }
pack() { tar czf "$OUT/.r.tgz" -C scratch b9b32-ms && mv "$OUT/.r.tgz" "$OUT/r.tgz"; }
log() { echo "$(date -u +%H:%M:%S) +$(( $(date +%s) - S ))s $*" >> "$O/calls.log"; }
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
ORACLE=""; [ "$MEM" -lt 100000 ] && ORACLE="--oracle-memory 30GiB"
N=$(ls $O/versions-*.txt 2>/dev/null | wc -l)
# the engine's memory changed (slots sized by the run, merged weights in place): measure its peak again once, so that
# the memory gate admits engines on the new peak (the old repeat kept for comparison; its digests must be equal)
if [ -f "$O/clean-seed0-repeat.jsonl" ] && [ ! -f "$O/repeat-before-engine-memory-change.jsonl" ]; then
  mv "$O/clean-seed0-repeat.jsonl" "$O/repeat-before-engine-memory-change.jsonl"; mv "$O/clean-seed0-repeat.log" "$O/repeat-before-engine-memory-change.log" 2>/dev/null
fi
# the drowned survivor again, so that its rows carry the class moments (the lower-limit table weighs it); once
Q=mutant-engine-merged-qkv-keys-not-rotated
if [ -f "$O/$Q.jsonl" ] && [ ! -f "$O/before-moments-$Q.jsonl" ]; then
  mv "$O/$Q.jsonl" "$O/before-moments-$Q.jsonl"; mv "$O/$Q.log" "$O/before-moments-$Q.log" 2>/dev/null
fi
if [ ! -f "$O/gpu-test.log" ]; then
  ( timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_memory.py \
      tests/mutants/test_scale_driver.py -k "no_holes or 16_bit_row" > "$O/gpu-test.log" 2>&1; echo "rc $?" >> "$O/gpu-test.log" ) &
fi
{ nvidia-smi; python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"; git log --oneline -1; } > "$O/versions-$N.txt" 2>&1
log "call $N start, GPU memory $MEM MiB, oracle flag '$ORACLE'"
if [ ! -f "$M/config.json" ]; then
  timeout 240 python3 -m harness.cli write-model bamba9b-32layer "$M" --device cuda > "$O/write-$N.log" 2>&1
  log "write-model rc=$?"
fi
# beside it: deep-bamba's three attention kills made by one position just past the budget, judged in every scenario
# (what a larger k would cost there); once
D=scratch/b9b32-ms/db-k
if [ ! -f "$D/done" ]; then
  mkdir -p "$D"
  ( timeout 330 python3 -m mutants.scale --model deep-bamba --model-dir fixtures/deep-bamba --budget-rule max,quantile \
      --clean-seeds 1 --dtypes bfloat16 --jobs 3 --every-scenario --resume --time-limit 300 --out "$D" \
      --only engine-merged-qkv-keys-not-rotated,rotary-rotates-backwards,engine-rope-positions-restart-each-piece \
      > "$D/driver-$N.log" 2>&1; echo "rc $?" >> "$D/driver-$N.log"; grep -q "0 incomplete, 0 not run" "$D/table.md" 2>/dev/null && touch "$D/done" ) &
fi
( while sleep 30; do pack; done ) & P=$!
( while sleep 10; do echo "$(date -u +%H:%M:%S) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)" >> "$O/smi-trace-$N.txt"; done ) & Q=$!
COMMON="--model bamba9b-32layer --model-dir $M --budget-rule max,quantile --clean-seeds 1 --jobs ${JOBS:-6} \
 --live-in results/2026-12-03-h200-scale-eighth,results/2026-12-06-h100-deep-bamba-scale --resume --out $O $ORACLE"
for D in bfloat16 float32; do
  L=$(( $(left) - 35 ))
  if [ "$L" -lt 60 ]; then log "$D: no time left ($L s)"; break; fi
  log "$D driver, time limit $L"
  timeout $(( L + 25 )) python3 -m mutants.scale $COMMON --dtypes $D --time-limit $L > "$O/driver-$D-$N.log" 2>&1
  log "$D driver rc=$?"
  cp "$O/table.md" "$O/table-$D.md" 2>/dev/null; cp "$O/report.json" "$O/report-$D.json" 2>/dev/null
done
kill $P $Q; df -h scratch > "$O/disk-$N.txt"; ls -la "$O" >> "$O/disk-$N.txt"; pack
log "call $N end"; pack
