#!/usr/bin/env bash
# Twelfth session, call 2 (nvidia-h200, one GPU): why call 1's sidecar bench on one GPU ran to its
# 100 s limit (here with --timeout=60 so the bench itself reports and keeps the sidecars' logs);
# doorbell_bench with max_poll_us 320 and 640 (the back-off's CPU curve; call 1 had 20 and 160).
# Run from .devstage: ../.devpack/call2.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
mkdir -p $o/s1
OUT=$o/s1 BENCH_LIMIT=90 SB_ARGS="--timeout=60" ./gpu-run sidecar > $o/s1/run.log 2>&1
for d in /tmp/arfbench-sc-*; do [ -d "$d" ] && mkdir -p $o/s1/keep && cp -r $d $o/s1/keep/; done
ps aux | grep -c "[a]rfused" > $o/s1/arfused-left.txt
for mp in 320 640; do
  for algo in oneshot twoshot; do
    mkdir -p $o/b-$algo-$mp
    OUT=$o/b-$algo-$mp BENCH_LIMIT=60 DBENCH_ARGS="--queue=8 --poll_us=20 --max_poll_us=$mp --algo=$algo --resident_ms=500" \
      ./gpu-run doorbell-bench > $o/b-$algo-$mp/run.log 2>&1
  done
done
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/s1/run.log $o/b-*/run.log
cat $o/s1/arfused-left.txt
tail -n 30 $o/s1/sidecar.log
for d in $o/b-*; do echo "--- $d"; grep -h "^ *[0-9]* .*ok\|WRONG\|resident" $d/doorbell-bench.log; done
