#!/usr/bin/env bash
set -uo pipefail
FINAL=$1; R=/tmp/r; mkdir -p "$R"; A=$(pwd)/ab
export LD_LIBRARY_PATH=$A/devlibs
nvidia-smi -L > "$R/nvidia-smi.txt" 2>&1
nvidia-smi -q -d CLOCK > "$R/clocks.txt" 2>&1
start=$SECONDS
for round in 1 2; do
  for v in D L L1; do
    echo "=== $v round $round t=$((SECONDS-start))" >> "$R/ab.log"
    CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 95 $A/$v/arfuse-bench-flashinfer --hidden=4096,8192 \
      --tokens=1,2,8,32,128,512,2048 --flashinfer_sms=0 --json="$R/ab-$v-$round.json" >> "$R/ab.log" 2>&1
    echo "=== $v round $round exit $? t=$((SECONDS-start))" >> "$R/ab.log"
    tar -C /tmp -czf "$FINAL/run.tgz" r
  done
done
