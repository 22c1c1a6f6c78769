#!/usr/bin/env bash
# Twelfth session, call 3 (nvidia-h200, one GPU): the sidecar bench's stall on one GPU (calls 1-2
# ran out their limits at 128 tokens, no op failure logged). The bench at 128 tokens with the
# sidecars' default 128 serving blocks, then with 64 and 32 (a wrapper adds the flag); doorbell_bench
# with both planes in one process at 128 tokens, 128 and 32 blocks (it prints the planes' counters
# every 2 s while a row stalls).
# Run from .devstage: ../.devpack/call3.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
for n in 128 64 32; do
  mkdir -p w$n && cp bin/libarfuse_ring.so w$n/ &&
  printf '#!/bin/sh\nexec %s/bin/arfused "$@" --doorbell-serve-blocks=%s\n' "$PWD" $n > w$n/arfused && chmod +x w$n/arfused
  mkdir -p $o/s$n
  OUT=$o/s$n BENCH_LIMIT=70 SB_ARGS="--timeout=50 --tokens=128 --hidden=4096 --arfused=$PWD/w$n/arfused" ./gpu-run sidecar > $o/s$n/run.log 2>&1
  for d in /tmp/arfbench-sc-*; do [ -d "$d" ] && mkdir -p $o/s$n/keep && cp $d/*.log $o/s$n/keep/ 2>/dev/null; rm -rf $d; done
done
for n in 128 32; do
  mkdir -p $o/b$n
  OUT=$o/b$n BENCH_LIMIT=45 DBENCH_ARGS="--tokens=128 --serve_blocks=$n --ops=1000" ./gpu-run doorbell-bench > $o/b$n/run.log 2>&1
done
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/s*/run.log $o/b*/run.log
for n in 128 64 32; do echo "--- sidecar $n"; grep -h "| doorbell \|| layer_doorbell\|| busy\|did not finish\|FAILED" $o/s$n/sidecar.log | cut -c1-160; done
for n in 128 32; do echo "--- doorbell_bench $n"; grep -h "stalled\|^ *128 \|failed" $o/b$n/doorbell-bench.log | head -12; done
