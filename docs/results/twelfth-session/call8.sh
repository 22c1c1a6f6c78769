#!/usr/bin/env bash
# Twelfth session, call 8 (nvidia-h200, one GPU): arfused with its new default of 16 serving
# blocks: the sidecar bench (with the register-heavy busy_sm rows), demo-doorbell, doorbell-engine.
# Run from .devstage: ../.devpack/call8.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o/s1
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o/s1 BENCH_LIMIT=100 SB_ARGS="--timeout=90 --iters=300" ./gpu-run sidecar > $o/s1/run.log 2>&1
OUT=$o BUNDLE=$B ./gpu-run demo-doorbell doorbell-engine > $o/run1.log 2>&1
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/s1/run.log $o/run1.log
grep -h "| busy\|| doorbell \|| layer_doorbell" $o/s1/sidecar.log | cut -d'|' -f2-8
tail -n 3 $o/demo-doorbell.log $o/doorbell-engine.log
