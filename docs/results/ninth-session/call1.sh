#!/usr/bin/env bash
# Ninth session, call 1 (nvidia-h200-x2): the serving launch completed by its last block, with
# the ticket in one word (new/ = bin/) against the eighth session's final build (old/).
# Run from .devstage: ../.devpack/call1.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
stage=$PWD
export LD_LIBRARY_PATH=$stage/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B DB_LIMIT=150 ./gpu-run doorbell > $o/run1.log 2>&1
OUT=$o BUNDLE=$B AB_VARIANTS="old new" AB_ROUNDS=3 ./gpu-run sidecar-ab > $o/run2.log 2>&1
# One process, both ranks on GPU 0, with the serving launch's trace: old, new, old, new.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
nvidia-cuda-mps-control -d 2>/dev/null; sleep 1
for v in old new old new; do
  CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 90 $stage/$v/doorbell_bench \
    --world=2 --hidden=4096 --tokens=1,8,32,128 --serve_blocks=128 --trace >> $o/trace-$v.log 2>&1
  echo "trace $v exit $?" >> $o/run3.log
done
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1
tar -C $o -czf $B.tmp . && mv $B.tmp $B
OUT=$o BUNDLE=$B BENCH_LIMIT=200 ./gpu-run sidecar doorbell-ipc demo-doorbell > $o/run4.log 2>&1
grep -h "^=== .*exit" $o/run1.log $o/run2.log $o/run4.log; cat $o/run3.log
grep -h "PASSED\|FAILED" $o/doorbell.log
for f in $o/sidecar-*-*.log; do echo "== $f"; grep -i "doorbell\|layer" $f | head -8; done
grep -h "^trace\|^ *[0-9]* *[0-9.]* *[0-9.]* *+" $o/trace-*.log
grep -i "doorbell\|eager\|layer" $o/sidecar.log | head -20
tail -3 $o/demo-doorbell.log $o/doorbell-ipc.log
