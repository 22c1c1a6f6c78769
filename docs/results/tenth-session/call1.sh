#!/usr/bin/env bash
# Tenth session, call 1 (nvidia-h200-x2): the one-shot's row arithmetic in fewer instructions
# (bin/: packed dtype rounding, packed sentinel tests, the two-rank sum and sentinel clear without
# the loop over ranks) against the build before it (old/), and a third build (p1/: bin/ with one
# vector per thread up to 512 vectors a row), alternately on one lease; then the kernel and
# doorbell GPU tests on bin/.
# Run from .devstage: ../.devpack/call1.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
pack() { tar -C $o -czf $B.tmp . && mv $B.tmp $B; }
kb() {  # name bin
  local name=$1 bin=$2
  echo "=== $name" >> $o/summary.log
  ( cd $o && timeout 150 $bin kernels --world=2 --json=$o/$name.json \
      --tokens=1,2,4,8,16,32,64,128,256,512,1024,2048 --hidden=4096,7168,8192 ) > $o/$name.log 2>&1
  echo "exit $?" >> $o/summary.log
  pack
}
for r in 1 2; do
  for v in old bin p1; do kb ab-$v-$r $PWD/$v/arfuse-bench; done
  if [ $r = 1 ]; then OUT=$o BUNDLE= ./gpu-run kernels > $o/corr1.log 2>&1; pack; fi
done
OUT=$o BUNDLE= DB_LIMIT=150 ./gpu-run doorbell > $o/corr2.log 2>&1
pack
cat $o/summary.log
grep -h "^=== .*exit\|passed\|failed" $o/corr1.log $o/corr2.log | head
