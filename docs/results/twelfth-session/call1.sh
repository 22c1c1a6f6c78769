#!/usr/bin/env bash
# Twelfth session, call 1 (nvidia-h200, one GPU, ranks under MPS): the doorbell plane's host
# thread backing off while nothing is consumed. doorbell GPU tests (with
# WhileNothingIsConsumedTheHostThreadBacksOff), doorbell_bench A/B (max_poll_us=20 = no back-off,
# against the default 160) at arfused's queue 8 / poll 20 us, one-shot and two-shot, resident
# spell 500 ms; doorbell-ipc, doorbell-engine, demo-doorbell, the sidecar bench.
# Run from .devstage: ../.devpack/call1.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B DB_LIMIT=150 ./gpu-run doorbell > $o/run1.log 2>&1
for r in 1 2; do
  for algo in oneshot twoshot; do
    for v in off on; do
      mp=""; [ $v = off ] && mp="--max_poll_us=20"
      mkdir -p $o/b-$algo-$v-$r
      OUT=$o/b-$algo-$v-$r BENCH_LIMIT=60 DBENCH_ARGS="--queue=8 --poll_us=20 $mp --algo=$algo --resident_ms=500" \
        ./gpu-run doorbell-bench > $o/b-$algo-$v-$r/run.log 2>&1
    done
  done
done
OUT=$o BUNDLE=$B ./gpu-run doorbell-ipc doorbell-engine demo-doorbell > $o/run2.log 2>&1
mkdir -p $o/s1
OUT=$o/s1 BENCH_LIMIT=100 ./gpu-run sidecar > $o/s1/run.log 2>&1
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/run*.log $o/b-*/run.log $o/s1/run.log
grep -h "PASSED\|FAILED" $o/doorbell.log
grep -h -A3 "WhileNothingIsConsumed" $o/doorbell.log | head -12
for d in $o/b-*; do echo "--- $d"; grep -h "^ *[0-9]* .*ok\|WRONG\|resident" $d/doorbell-bench.log; done
tail -n 2 $o/demo-doorbell.log $o/doorbell-ipc.log $o/doorbell-engine.log
grep -i "| doorbell \|| layer_doorbell\|| eager " $o/s1/sidecar.log | cut -d'|' -f2-9
