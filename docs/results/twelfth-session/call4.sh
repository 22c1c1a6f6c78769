#!/usr/bin/env bash
# Twelfth session, call 4 (nvidia-h200, one GPU): every kernel loaded before any can spin
# (Prepare*Kernels; lazy module loading otherwise loads a kernel at its first launch and that load
# may wait for a resident spinning kernel). doorbell_bench in a fresh process (its self-test failed
# in every recorded run), doorbell_bench at 128 tokens with 128 serving blocks (call 3: stalled),
# the sidecar bench on one GPU with its defaults (calls 1-3: stalled at 128 tokens), the doorbell
# GPU tests, doorbell-engine, demo-doorbell.
# Run from .devstage: ../.devpack/call4.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
mkdir -p $o/b1 $o/b128 $o/s1
OUT=$o/b1 BENCH_LIMIT=60 DBENCH_ARGS="--queue=8 --poll_us=20" ./gpu-run doorbell-bench > $o/b1/run.log 2>&1
OUT=$o/b128 BENCH_LIMIT=45 DBENCH_ARGS="--tokens=128 --serve_blocks=128 --ops=1000" ./gpu-run doorbell-bench > $o/b128/run.log 2>&1
OUT=$o/s1 BENCH_LIMIT=110 SB_ARGS="--timeout=90" ./gpu-run sidecar > $o/s1/run.log 2>&1
for d in /tmp/arfbench-sc-*; do [ -d "$d" ] && mkdir -p $o/s1/keep && cp $d/*.log $o/s1/keep/ 2>/dev/null; done
OUT=$o BUNDLE=$B DB_LIMIT=150 ./gpu-run doorbell doorbell-engine demo-doorbell > $o/run1.log 2>&1
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/b*/run.log $o/s1/run.log $o/run1.log
grep -h "self-test\|stalled\|^ *[0-9]* .*ok\|WRONG\|resident" $o/b1/doorbell-bench.log $o/b128/doorbell-bench.log | cut -c1-160 | head -30
grep -h "| doorbell \|| layer_doorbell\|| eager \|| busy_idle\|FAILED\|did not" $o/s1/sidecar.log | cut -d'|' -f2-9 | head -20
grep -h "self_test " $o/s1/keep/*.log 2>/dev/null | cut -c1-200
grep -h "PASSED\|FAILED" $o/doorbell.log; grep -h "SelfTest" -A3 $o/doorbell.log | head -5
tail -n 3 $o/demo-doorbell.log $o/doorbell-engine.log
