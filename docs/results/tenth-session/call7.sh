#!/usr/bin/env bash
# Tenth session, call 7 (nvidia-h200-x4): the one-shot's wait above two ranks polling two ranks'
# vectors at a time and summing as they come (bin/) against the build before (prev/: b291883,
# one peer after the other, then a re-read for the sum), alternately: world size 4 twice each,
# world size 2 (GPUs 0-1) twice each at 1-128 tokens; then the kernel and multi-process GPU
# tests on bin/ (world 4 one rank per GPU).
# Run from .devstage: ../.devpack/call7.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; S=$PWD; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
kb() {  # name bin world args
  local name=$1 bin=$2 w=$3; shift 3
  echo "=== $name" >> $o/summary.log
  ( cd $o && timeout 200 $S/$bin/arfuse-bench kernels --world=$w --json=$o/$name.json "$@" ) \
    > $o/$name.log 2>&1
  echo "exit $?" >> $o/summary.log
}
for r in 1 2; do
  for v in prev bin; do kb w4-$v-$r $v 4; done
  for v in prev bin; do
    CUDA_VISIBLE_DEVICES=0,1 kb w2-$v-$r $v 2 --tokens=1,2,4,8,16,32,64,128 --hidden=4096,7168,8192
  done
  tar -C $o -czf $B.tmp . && mv $B.tmp $B
done
OUT=$o BUNDLE=$B ./gpu-run kernels multiproc > $o/corr.log 2>&1
cat $o/summary.log
grep -h "^=== .*exit" $o/corr.log
grep -h "PASSED\|FAILED" $o/kernels.log $o/multiproc.log
