#!/usr/bin/env bash
# Ninth session, call 5 (nvidia-h200-x2): the parked blocks' ticket poll every 32 ns (bin/, the
# final build) against 100 ns (n100/: the build of call 4), alternately on one lease; then the
# doorbell GPU tests and the demo's doorbell rows on the final build.
# Run from .devstage: ../.devpack/call5.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B AB_VARIANTS="n100 bin" AB_ROUNDS=2 ./gpu-run sidecar-ab > $o/run1.log 2>&1
OUT=$o BUNDLE=$B DB_LIMIT=150 ./gpu-run doorbell demo-doorbell > $o/run2.log 2>&1
grep -h "^=== .*exit" $o/run1.log $o/run2.log
grep -h "PASSED\|FAILED" $o/doorbell.log
for f in $o/sidecar-*-*.log; do echo "== $f"; grep "| doorbell |\|busy_idle" $f | cut -d'|' -f2-8; done
tail -n 3 $o/demo-doorbell.log
