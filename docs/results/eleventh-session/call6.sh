#!/usr/bin/env bash
# Eleventh session, call 6 (nvidia-h200-x2): the final code (183d182: arfused exits on a GPU it
# cannot use), the reliability tests (fault scenarios and load) on two GPUs.
# Run from .devstage: ../.devpack/call6.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B REL_LIMIT=330 ./gpu-run reliability > $o/run1.log 2>&1
grep -h "^=== .*exit" $o/run1.log
grep -h "PASSED\|FAILED" $o/reliability-fault.log
grep -A3 'rank      ops' $o/reliability-load.log
