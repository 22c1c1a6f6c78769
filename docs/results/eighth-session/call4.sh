#!/usr/bin/env bash
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B DB_LIMIT=150 BENCH_LIMIT=200 ./gpu-run kernels doorbell multiproc bench sidecar doorbell-ipc demo-doorbell > $o/run1.log 2>&1
OUT=$o BUNDLE=$B GPUS=2 ./gpu-run tp > $o/run2.log 2>&1
grep -h "^=== .*exit" $o/run1.log $o/run2.log
grep -h "PASSED\|FAILED" $o/kernels.log $o/doorbell.log $o/multiproc.log
grep '^|' $o/bench.log | cut -d'|' -f2-7,10-11 | head -40
grep -i "doorbell\|eager\|layer" $o/sidecar.log | head -30
tail -5 $o/tp-2gpu.log
