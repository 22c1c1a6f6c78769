#!/usr/bin/env bash
# Eleventh session, call 4 (nvidia-h200-x2): arfused exits on a device it cannot use (restart-only
# CUDA errors such as cudaErrorDevicesUnavailable) instead of retrying in-process, and
# arfuse-demo stops at once when a sidecar exits. The multi-process tests (they end with the one
# that wedges GPU 0 with a stuck NCCL kernel), then the eager demo again and again (60 s limit
# each, 3 s apart) until it passes or 150 s have gone, then the doorbell demo.
# Run from .devstage: ../.devpack/call4.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B ./gpu-run multiproc > $o/run1.log 2>&1
t0=$SECONDS
for i in $(seq 1 12); do
  mkdir -p $o/demo$i
  OUT=$o/demo$i DEMO_ARGS=--timeout=60 ./gpu-run demo > $o/demo$i/run.log 2>&1
  echo "demo attempt $i at +$((SECONDS - t0)) s: $(grep -h '=== demo: exit' $o/demo$i/run.log)" \
    >> $o/summary.log
  grep -q "=== demo: exit 0" $o/demo$i/run.log && break
  [ $((SECONDS - t0)) -gt 150 ] && break
  sleep 3
done
OUT=$o BUNDLE=$B ./gpu-run demo-doorbell > $o/run3.log 2>&1
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/run1.log $o/run3.log
grep -h "PASSED\|FAILED" $o/multiproc.log
cat $o/summary.log
grep -h "exited with code\|sticky_device_error\|DevicesUnavailable" $o/demo1/demo.log | cut -c1-240 | head -6
tail -n 2 $o/demo-doorbell.log
