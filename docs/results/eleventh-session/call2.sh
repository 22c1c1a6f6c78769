#!/usr/bin/env bash
# Eleventh session, call 2 (nvidia-h200-x2): the session's final code, the GPU suite but the
# reliability tests (call 3): kernels, doorbell (with WithoutPlansTheHostThreadSleeps),
# multiproc, demo (eager), demo-doorbell, doorbell-ipc, doorbell-engine, switch, TP decode on two
# GPUs, arfuse-bench kernels three times and sidecar twice.
# Run from .devstage: ../.devpack/call2.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B DB_LIMIT=150 ./gpu-run kernels doorbell multiproc demo demo-doorbell doorbell-ipc \
  doorbell-engine switch > $o/run1.log 2>&1
OUT=$o BUNDLE=$B GPUS=2 ./gpu-run tp > $o/run2.log 2>&1
for r in 1 2 3; do
  mkdir -p $o/r$r
  OUT=$o/r$r BENCH_LIMIT=60 ./gpu-run bench > $o/r$r/run.log 2>&1
done
for r in 1 2; do
  mkdir -p $o/s$r
  OUT=$o/s$r BENCH_LIMIT=100 ./gpu-run sidecar > $o/s$r/run.log 2>&1
done
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/run*.log $o/r*/run.log $o/s*/run.log
grep -h "PASSED\|FAILED" $o/kernels.log $o/doorbell.log $o/multiproc.log
grep -h "WithoutPlansTheHostThreadSleeps" $o/doorbell.log
tail -n 2 $o/tp-2gpu.log $o/demo.log $o/demo-doorbell.log $o/doorbell-ipc.log
for s in 1 2; do grep -i "| doorbell \|| layer_doorbell\|| eager " $o/s$s/sidecar.log | cut -d'|' -f2-9; done
