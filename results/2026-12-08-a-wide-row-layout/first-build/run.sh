#!/usr/bin/env bash
# A/B of the fused kernels' bench (D = f926a84, W = f926a84 + W.diff, staged by scripts/gpu-stage
# into .devstage; D.xz: D's xz-compressed arfuse-bench-flashinfer), then W's GPU tests.
set -uo pipefail
FINAL=$1; R=/tmp/r; mkdir -p "$R"; S=$(pwd)/.devstage
export LD_LIBRARY_PATH=$S/bin:$S/devlibs
nvidia-smi -L > "$R/nvidia-smi.txt" 2>&1
xz -dc D.xz > /tmp/D-bench && chmod +x /tmp/D-bench
start=$SECONDS
for round in 1 2 3; do
  for v in D W; do
    b=$S/bin/arfuse-bench-flashinfer; [ $v = D ] && b=/tmp/D-bench
    echo "=== $v round $round t=$((SECONDS-start))" >> "$R/ab.log"
    CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 95 $b --hidden=4096,8192 \
      --tokens=1,2,8,16,32,64,128,512,2048 --flashinfer_sms=0 --json="$R/ab-$v-$round.json" >> "$R/ab.log" 2>&1
    echo "=== $v round $round exit $? t=$((SECONDS-start))" >> "$R/ab.log"
  done
  tar -C /tmp -czf "$FINAL/run.tgz" r
done
mkdir -p "$R/tests"
OUT=$R/tests BUNDLE=$FINAL/tests.tgz timeout -k 10 ${TLIMIT:-400} $S/gpu-run kernels kernels-fp8 kernels-fp8-unfused kernels-fp8-math instream doorbell > "$R/gpu-run.log" 2>&1
echo "gpu-run exit $? t=$((SECONDS-start))" >> "$R/gpu-run.log"
tar -C /tmp -czf "$FINAL/run.tgz" r
tail -30 "$R/gpu-run.log"
