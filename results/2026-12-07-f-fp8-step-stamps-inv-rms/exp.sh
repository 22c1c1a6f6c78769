#!/usr/bin/env bash
# Device run: the one-shot step stamps of D (a diagnostic build of arfuse-bench-flashinfer,
# st.xz), arfuse-bench epilogue of D (.devstage/ab/D) and E (.devstage/bin), E's GPU
# tests, arfuse-bench-flashinfer D and E in turn (two rounds). Results under /tmp/r, packed into
# $1/run.tgz after each step.
set -uo pipefail
FINAL=$1
R=/tmp/r
mkdir -p "$R"
S=$(pwd)/.devstage
pack() { tar -C /tmp -czf "$FINAL/run.tgz.tmp" r && mv "$FINAL/run.tgz.tmp" "$FINAL/run.tgz"; }
export LD_LIBRARY_PATH=$S/bin:$S/devlibs
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
xz -dc st.xz > /tmp/st-bench && chmod +x /tmp/st-bench
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 90 /tmp/st-bench --hidden=4096,8192 --tokens=1,8,128 \
  --flashinfer_sms=0 --json="$R/st.json" > "$R/st.log" 2>&1
echo "exit $?" >> "$R/st.log"
pack
bin_of() { [ "$1" = E ] && echo "$S/bin" || echo "$S/ab/$1"; }
for rows in 64 1; do
  for v in D E; do
    b=$(bin_of $v)
    echo "=== epilogue $v rows $rows" >> "$R/epilogue.log"
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 60 "$b/arfuse-bench" epilogue --hidden=4096,8192 --rows=$rows --repeats=30 >> "$R/epilogue.log" 2>&1
    echo "=== epilogue $v rows $rows exit $?" >> "$R/epilogue.log"
  done
done
pack
for round in 1 2; do
  for v in D E; do
    b=$(bin_of $v)
    echo "=== $v round $round $(date +%s)" >> "$R/ab.log"
    CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 90 "$b/arfuse-bench-flashinfer" --hidden=4096,8192 \
      --tokens=1,2,8,32,128,512,2048 --flashinfer_sms=0 --json="$R/ab-$v-$round.json" >> "$R/ab.log" 2>&1
    echo "=== $v round $round exit $? $(date +%s)" >> "$R/ab.log"
  done
  pack
done
OUT=$R/tests timeout -k 5 280 "$S/gpu-run" kernels-fp8-math kernels kernels-fp8 kernels-fp8-unfused instream > "$R/gpu-run.log" 2>&1
echo "gpu-run rc $?" >> "$R/gpu-run.log"
pack
