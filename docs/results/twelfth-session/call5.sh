#!/usr/bin/env bash
# Twelfth session, call 5 (nvidia-h200, one GPU): the session's final GPU code. The sidecar bench
# on one GPU with its defaults (calls 1-4 stalled at 128 tokens; the sidecars now cap their serving
# launches at 32 blocks when ranks share the GPU), kernels, doorbell, doorbell-ipc,
# doorbell-engine, demo (eager), demo-doorbell, TP decode (one GPU), multiproc (last: its final
# test wedges the GPU on purpose).
# Run from .devstage: ../.devpack/call5.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o/s1
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o/s1 BENCH_LIMIT=110 SB_ARGS="--timeout=90" ./gpu-run sidecar > $o/s1/run.log 2>&1
for d in /tmp/arfbench-sc-*; do [ -d "$d" ] && mkdir -p $o/s1/keep && cp $d/*.log $o/s1/keep/ 2>/dev/null; done
OUT=$o BUNDLE=$B DB_LIMIT=150 ./gpu-run kernels doorbell doorbell-ipc doorbell-engine demo demo-doorbell > $o/run1.log 2>&1
OUT=$o BUNDLE=$B GPUS=1 ./gpu-run tp > $o/run2.log 2>&1
OUT=$o BUNDLE=$B ./gpu-run multiproc > $o/run3.log 2>&1
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/s1/run.log $o/run*.log
grep -h "| doorbell \|| layer_doorbell\|| eager \|| busy_idle\|FAILED\|did not" $o/s1/sidecar.log | cut -d'|' -f2-9 | head -20
grep -h "serve_blocks_capped\|event=doorbell_self_test " $o/s1/keep/*.log 2>/dev/null | cut -c1-200
grep -h "PASSED\|FAILED" $o/kernels.log $o/doorbell.log $o/multiproc.log $o/doorbell-ipc.log $o/doorbell-engine.log
tail -n 2 $o/demo.log $o/demo-doorbell.log $o/tp-1gpu.log
