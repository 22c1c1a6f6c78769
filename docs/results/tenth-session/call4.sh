#!/usr/bin/env bash
# Tenth session, call 4 (nvidia-h200-x2): the op agreement's variants on the committed build
# 9f2344c (ARFUSE_FUSION_TUNING opcheck: 3 auto = per thread for one-block launches, per block
# otherwise; 2 = per thread everywhere; 0 = off, for measurement only), alternately, two runs each.
# Run from .devstage: ../.devpack/call4.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; S=$PWD; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
for r in 1 2; do
  for v in 3 2 0; do
    echo "=== opcheck=$v run $r" >> $o/summary.log
    ( cd $o && ARFUSE_FUSION_TUNING=opcheck=$v timeout 150 $S/bin/arfuse-bench \
        kernels --world=2 --json=$o/op$v-$r.json --tokens=1,2,4,8,16,32,64,128,256,512 \
        --hidden=4096,7168,8192 ) > $o/op$v-$r.log 2>&1
    echo "exit $?" >> $o/summary.log
  done
done
tar -C $o -czf $B.tmp . && mv $B.tmp $B
cat $o/summary.log
