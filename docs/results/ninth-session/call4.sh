#!/usr/bin/env bash
# Ninth session, call 4 (nvidia-h200-x2): the final build (block 0 zeroes the serving launch's
# count after each op, so that its closing add after a deadline cannot race the zeroing): the
# doorbell GPU tests, the sidecar bench, the doorbell through arfused and through client processes.
# Run from .devstage: ../.devpack/call4.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B DB_LIMIT=150 BENCH_LIMIT=200 ./gpu-run doorbell sidecar demo-doorbell doorbell-ipc > $o/run1.log 2>&1
grep -h "^=== .*exit" $o/run1.log
grep -h "PASSED\|FAILED" $o/doorbell.log $o/doorbell-ipc.log
grep "| doorbell |\|| eager |\|layer_doorbell" $o/sidecar.log | cut -d'|' -f2-8
tail -n 6 $o/demo-doorbell.log
