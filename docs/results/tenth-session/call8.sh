#!/usr/bin/env bash
# Tenth session, call 8 (nvidia-h200-x2): the final build (2132dc1), the GPU tests not yet run on
# it (kernels and multiproc ran on its code in call 7): doorbell, demo-doorbell, doorbell-ipc,
# doorbell-engine, switch, TP decode on two GPUs, arfuse-bench kernels and sidecar once each,
# then reliability.
# Run from .devstage: ../.devpack/call8.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B DB_LIMIT=150 ./gpu-run doorbell demo-doorbell doorbell-ipc doorbell-engine switch > $o/run1.log 2>&1
OUT=$o BUNDLE=$B GPUS=2 ./gpu-run tp > $o/run2.log 2>&1
OUT=$o BUNDLE=$B BENCH_LIMIT=200 ./gpu-run bench sidecar > $o/run3.log 2>&1
OUT=$o BUNDLE=$B REL_LIMIT=330 ./gpu-run reliability > $o/run4.log 2>&1
grep -h "^=== .*exit" $o/run*.log
grep -h "PASSED\|FAILED" $o/doorbell.log $o/reliability-fault.log
grep -i "| doorbell\|| layer_doorbell" $o/sidecar.log | cut -d'|' -f2-9
tail -n 2 $o/tp-2gpu.log $o/demo-doorbell.log $o/doorbell-ipc.log
grep -A3 'rank      ops' $o/reliability-load.log
