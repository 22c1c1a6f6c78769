#!/usr/bin/env bash
# Ninth session, call 2 (nvidia-h200-x2): the new build's remaining GPU steps that use the
# doorbell plane (doorbell-engine, switch), an A/B of the parked blocks' ticket poll (b32/: 32 ns
# sleep between polls, against bin/: 100 ns), and the serving launch's trace (both ranks on GPU 0,
# the bench's default 32 blocks), old/ (eighth session) and new/ alternately.
# Run from .devstage: ../.devpack/call2.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
stage=$PWD
export LD_LIBRARY_PATH=$stage/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B AB_VARIANTS="new b32" AB_ROUNDS=3 ./gpu-run sidecar-ab > $o/run1.log 2>&1
OUT=$o BUNDLE=$B ./gpu-run doorbell-engine switch > $o/run2.log 2>&1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
nvidia-cuda-mps-control -d 2>/dev/null; sleep 1
for v in old new old new; do
  CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 60 $stage/$v/doorbell_bench \
    --world=2 --hidden=4096 --tokens=1,8,32,128 --trace >> $o/trace-$v.log 2>&1
  echo "trace $v exit $?" >> $o/run3.log
done
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/run1.log $o/run2.log; cat $o/run3.log
for f in $o/sidecar-*-*.log; do echo "== $f"; grep "| doorbell |" $f | cut -d'|' -f2-8; done
grep -h "^trace\|^ *[0-9]* *[0-9.]* *[0-9.]* *+" $o/trace-*.log
grep -h "PASSED\|FAILED" $o/doorbell-engine.log; tail -n 5 $o/switch.log
