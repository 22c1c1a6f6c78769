#!/usr/bin/env bash
# Tenth session, call 3 (nvidia-h200-x2): the committed build (9f2344c), the rest of the GPU
# suite: reliability (fault scenarios + load), then the multi-process tests.
# Run from .devstage: ../.devpack/call3.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B REL_LIMIT=330 ./gpu-run reliability > $o/run1.log 2>&1
OUT=$o BUNDLE=$B ./gpu-run multiproc > $o/run2.log 2>&1
grep -h "^=== .*exit" $o/run1.log $o/run2.log
grep -h "PASSED\|FAILED" $o/reliability-fault.log $o/multiproc.log
tail -n 4 $o/reliability-load.log
