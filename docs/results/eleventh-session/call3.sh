#!/usr/bin/env bash
# Eleventh session, call 3 (nvidia-h200-x2): the session's final code. The eager demo on a fresh
# machine (in call 2 it ran right after the multi-process test that wedges a GPU with a stuck NCCL
# kernel, and its sidecars got cudaErrorDevicesUnavailable for its whole 100 s); the reliability
# tests (fault scenarios and load); then that wedge test alone followed by the demo again, to see
# how long a wedged GPU refuses new processes under MPS.
# Run from .devstage: ../.devpack/call3.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B ./gpu-run demo > $o/run1.log 2>&1
OUT=$o BUNDLE=$B REL_LIMIT=330 ./gpu-run reliability > $o/run2.log 2>&1
mkdir -p $o/wedge
OUT=$o/wedge MFILTER='*NcclAgreedOpNeverRunWedgesTheDevice*' DEMO_ARGS=--timeout=130 ./gpu-run \
  multiproc demo > $o/wedge/run.log 2>&1
tar -C $o -czf $B.tmp . && mv $B.tmp $B
grep -h "^=== .*exit" $o/run1.log $o/run2.log $o/wedge/run.log
tail -n 3 $o/demo.log
grep -h "PASSED\|FAILED" $o/reliability-fault.log
grep -A3 'rank      ops' $o/reliability-load.log
grep -c "DevicesUnavailable" $o/wedge/demo.log; grep -h "=== demo: exit" $o/wedge/run.log
tail -n 3 $o/wedge/demo.log
