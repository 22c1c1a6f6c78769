#!/usr/bin/env bash
set -uo pipefail
FINAL=$1; R=/tmp/r; mkdir -p "$R"; S=$(pwd)/.devstage
export LD_LIBRARY_PATH=$S/bin:$S/devlibs
xz -dc p.xz > /tmp/p-bench && chmod +x /tmp/p-bench
nvidia-smi -L > "$R/nvidia-smi.txt" 2>&1
for round in 1 2 3; do
  for v in D P; do
    b=$S/ab/D/arfuse-bench-flashinfer; [ $v = P ] && b=/tmp/p-bench
    echo "=== $v round $round" >> "$R/ab.log"
    CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 90 $b --hidden=4096,8192 \
      --tokens=1,2,8,32,128,512 --flashinfer_sms=0 --json="$R/ab-$v-$round.json" >> "$R/ab.log" 2>&1
    echo "=== $v round $round exit $?" >> "$R/ab.log"
  done
  tar -C /tmp -czf "$FINAL/run.tgz" r
done
