#!/usr/bin/env bash
# Ninth session, call 3 (nvidia-h200-x2): the final build's other GPU steps: the fault and load
# tests against CUDA sidecars, TP decode on two GPUs, the kernel tests, the multi-process tests
# (last: after them new CUDA processes may not get the GPU under MPS).
# Run from .devstage: ../.devpack/call3.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
stage=$PWD
export LD_LIBRARY_PATH=$stage/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
OUT=$o BUNDLE=$B REL_LIMIT=330 ./gpu-run reliability > $o/run1.log 2>&1
OUT=$o BUNDLE=$B GPUS=2 ./gpu-run tp > $o/run2.log 2>&1
OUT=$o BUNDLE=$B ./gpu-run kernels multiproc > $o/run3.log 2>&1
grep -h "^=== .*exit" $o/run1.log $o/run2.log $o/run3.log
grep -h "PASSED\|FAILED" $o/reliability-fault.log $o/kernels.log $o/multiproc.log
tail -n 4 $o/reliability-load.log $o/tp-2gpu.log
