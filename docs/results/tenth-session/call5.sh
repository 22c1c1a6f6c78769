#!/usr/bin/env bash
# Tenth session, call 5 (nvidia-h200-x2): the op agreement's automatic choice per thread for
# launches of up to 4 blocks (bin/) against per thread for one-block launches only (prev/: the
# committed build 9f2344c), alternately, three runs each; then the kernel, doorbell and
# multi-process GPU tests on bin/.
# Run from .devstage: ../.devpack/call5.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; S=$PWD; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
for r in 1 2 3; do
  for v in prev bin; do
    echo "=== $v run $r" >> $o/summary.log
    ( cd $o && timeout 150 $S/$v/arfuse-bench kernels --world=2 --json=$o/ab-$v-$r.json \
        --tokens=1,2,3,4,6,8,16,32,128 --hidden=4096,7168,8192 ) > $o/ab-$v-$r.log 2>&1
    echo "exit $?" >> $o/summary.log
  done
done
tar -C $o -czf $B.tmp . && mv $B.tmp $B
OUT=$o BUNDLE=$B DB_LIMIT=150 ./gpu-run kernels doorbell multiproc > $o/corr.log 2>&1
cat $o/summary.log
grep -h "^=== .*exit" $o/corr.log
grep -h "PASSED\|FAILED" $o/kernels.log $o/doorbell.log $o/multiproc.log
