#!/usr/bin/env bash
# Not run yet: the A/B of D (f926a84), W2 (f926a84 + W2.diff, staged by scripts/gpu-stage into
# .devstage) and W (first-build/W.diff), then W2's GPU tests. D.xz and W.xz: the xz-compressed
# arfuse-bench-flashinfer binaries of D and W, in the working directory.
set -uo pipefail
FINAL=$1; R=/tmp/r; mkdir -p "$R"; S=$(pwd)/.devstage
export LD_LIBRARY_PATH=$S/bin:$S/devlibs
nvidia-smi -L > "$R/nvidia-smi.txt" 2>&1
for v in D W; do xz -dc $v.xz > /tmp/$v-bench && chmod +x /tmp/$v-bench; done
cp $S/bin/arfuse-bench-flashinfer /tmp/W2-bench
start=$SECONDS
for round in 1 2 3; do
  vs="D W2"; [ $round = 2 ] && vs="D W2 W"
  for v in $vs; do
    echo "=== $v round $round t=$((SECONDS-start))" >> "$R/ab.log"
    CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 95 /tmp/$v-bench --hidden=4096,8192 \
      --tokens=1,2,8,16,32,64,128,512,2048 --flashinfer_sms=0 --json="$R/ab-$v-$round.json" >> "$R/ab.log" 2>&1
    echo "=== $v round $round exit $? t=$((SECONDS-start))" >> "$R/ab.log"
  done
  tar -C /tmp -czf "$FINAL/run.tgz" r
done
mkdir -p "$R/tests"
OUT=$R/tests BUNDLE=$FINAL/tests.tgz timeout -k 10 ${TLIMIT:-400} $S/gpu-run kernels kernels-fp8 kernels-fp8-unfused kernels-fp8-math instream doorbell > "$R/gpu-run.log" 2>&1
echo "gpu-run exit $? t=$((SECONDS-start))" >> "$R/gpu-run.log"
tar -C /tmp -czf "$FINAL/run.tgz" r
grep -E "=== |PASSED|FAILED" "$R/gpu-run.log" | tail -20
