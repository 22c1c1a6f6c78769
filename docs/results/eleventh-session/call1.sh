#!/usr/bin/env bash
# Eleventh session, call 1 (nvidia-h200-x2): the Lamport spin shared by both waits and the
# two-rank sum next to its wait (bin/) against the committed build 85ad2e5 (prev/): arfuse-bench
# kernels alternately, two runs each; the one-shot's push-ahead knobs at 512-2048 tokens on bin/;
# arfuse-bench sidecar alternately (doorbell A/B), two runs each; then the kernel, doorbell and
# multi-process GPU tests on bin/.
# Run from .devstage: ../.devpack/call1.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; S=$PWD; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
for r in 1 2; do
  for v in prev bin; do
    ( cd $o && timeout 120 $S/$v/arfuse-bench kernels --world=2 --json=$o/ab-$v-$r.json ) \
      > $o/ab-$v-$r.log 2>&1
    echo "kernels $v run $r exit $?" >> $o/summary.log
  done
done
i=0
for t in lookahead=1 lookahead=2 lookahead=4 ctas_per_sm=1,lookahead=8 lookahead=1; do
  i=$((i + 1))
  ( cd $o && ARFUSE_FUSION_TUNING=$t timeout 60 $S/bin/arfuse-bench kernels --world=2 \
      --tokens=512,1024,2048 --hidden=4096,7168,8192 --json=$o/knob-$i.json ) > $o/knob-$i.log 2>&1
  echo "knob $i $t exit $?" >> $o/summary.log
done
tar -C $o -czf $B.tmp . && mv $B.tmp $B
OUT=$o BUNDLE=$B AB_VARIANTS="prev bin" AB_ROUNDS=2 BENCH_LIMIT=120 ./gpu-run sidecar-ab \
  > $o/sab.log 2>&1
OUT=$o BUNDLE=$B DB_LIMIT=150 ./gpu-run kernels doorbell multiproc > $o/corr.log 2>&1
cat $o/summary.log
grep -h "^=== .*exit" $o/sab.log $o/corr.log
grep -h "PASSED\|FAILED" $o/kernels.log $o/doorbell.log $o/multiproc.log
for f in $o/sidecar-*.log; do echo "$f"; grep -i "| doorbell \|| inproc " $f | cut -d'|' -f2-8; done
