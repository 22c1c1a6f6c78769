#!/usr/bin/env bash
# Twelfth session, call 7 (nvidia-h200, one GPU): what the sidecar's resident serving launch costs
# a register-heavy client kernel (new rows busy_sm / busy_sm_idle: one 1024-thread block per SM
# needing more than half of its registers), with the sidecars' serving blocks at 0 (waiter only),
# 16 and the shared-GPU default (32), at 1 / 16 / 128 tokens.
# Run from .devstage: ../.devpack/call7.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
for n in 0 16; do
  mkdir -p w$n && cp bin/libarfuse_ring.so w$n/ &&
  printf '#!/bin/sh\nexec %s/bin/arfused "$@" --doorbell-serve-blocks=%s\n' "$PWD" $n > w$n/arfused && chmod +x w$n/arfused
done
mkdir -p $o/s32 $o/s16 $o/s0
OUT=$o/s32 BENCH_LIMIT=100 SB_ARGS="--timeout=90 --iters=300" ./gpu-run sidecar > $o/s32/run.log 2>&1
for n in 16 0; do
  OUT=$o/s$n BENCH_LIMIT=100 SB_ARGS="--timeout=90 --iters=300 --arfused=$PWD/w$n/arfused" ./gpu-run sidecar > $o/s$n/run.log 2>&1
done
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/s*/run.log
for n in 32 16 0; do echo "--- serve blocks $n"; grep -h "| busy\|| doorbell " $o/s$n/sidecar.log | cut -d'|' -f2-9; done
