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
{ nvidia-smi; python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"; git log --oneline -1; } > "$O/versions-$N.txt" 2>&1
log "call $N start, GPU memory $MEM MiB, oracle flag '$ORACLE'"
if [ ! -f "$M/config.json" ]; then
  timeout 240 python3 -m harness.cli write-model bamba9b-32layer "$M" --device cuda > "$O/write-$N.log" 2>&1
  log "write-model rc=$?"
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
