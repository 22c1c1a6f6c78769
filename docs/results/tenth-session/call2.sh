#!/usr/bin/env bash
# Tenth session, call 2 (nvidia-h200-x2): the committed build (9f2344c). arfuse-bench kernels
# three times, arfuse-bench sidecar twice, TP decode on two GPUs, then the kernel, doorbell,
# demo-doorbell, doorbell-ipc, doorbell-engine and backend-switch GPU tests.
# Run from .devstage: ../.devpack/call2.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
for r in 1 2 3; do mkdir -p $o/r$r; OUT=$o/r$r BUNDLE= ./gpu-run bench >> $o/run1.log 2>&1; done
tar -C $o -czf $B.tmp . && mv $B.tmp $B
for r in 1 2; do mkdir -p $o/s$r; OUT=$o/s$r BUNDLE= BENCH_LIMIT=200 ./gpu-run sidecar >> $o/run2.log 2>&1; done
tar -C $o -czf $B.tmp . && mv $B.tmp $B
OUT=$o BUNDLE=$B GPUS=2 ./gpu-run tp > $o/run3.log 2>&1
OUT=$o BUNDLE=$B DB_LIMIT=150 ./gpu-run kernels doorbell demo-doorbell doorbell-ipc doorbell-engine switch > $o/run4.log 2>&1
grep -h "^=== .*exit" $o/run*.log
grep -h "PASSED\|FAILED" $o/kernels.log $o/doorbell.log
for s in 1 2; do grep -i "| doorbell\|| layer_doorbell\|| eager |" $o/s$s/sidecar.log | cut -d'|' -f2-9; done
tail -n 3 $o/tp-2gpu.log $o/demo-doorbell.log $o/doorbell-ipc.log
