#!/usr/bin/env bash
# Runs the GPU tests and/or the kernel benchmark on a GPU machine from a folder made by
# stage-for-device.sh. Starts MPS when ranks must share GPUs and no daemon runs (and stops the
# one it started). NVLink multicast stays off (NCCL_NVLS_ENABLE=0); arfuse never uses it.
# usage: run-on-device.sh STAGE_DIR [tests|bench|all] [extra arfuse-bench kernels flags...]
#   GTEST_FILTER=... picks tests; OUT=... (default STAGE_DIR/out) receives logs, XML and JSON.
set -uo pipefail
stage=$(cd "${1:?usage: run-on-device.sh STAGE_DIR [tests|bench|all]}" && pwd)
what=${2:-all}
shift $(( $# >= 2 ? 2 : 1 ))
export LD_LIBRARY_PATH=$stage/devlibs:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mps-pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/mps-log}
out=${OUT:-$stage/out}
mkdir -p "$out" "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
started_mps=0
if [ ! -p "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
  nvidia-cuda-mps-control -d && started_mps=1
  sleep 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader || true
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  "$stage/bin/arfuse_gpu_multiproc_test" ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} --gtest_output="xml:$out/gpu-tests.xml" 2>&1 |
    tee "$out/gpu-tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  world=2
  for a in "$@"; do case $a in --world=*) world=${a#--world=} ;; esac; done
  (cd "$out" && "$stage/bin/arfuse-bench" kernels --world="$world" "$@" \
      --json="$out/bench-kernels-world$world.json") 2>&1 | tee "$out/bench-kernels-world$world.log"
  brc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && rc=$brc
fi
if [ "$started_mps" = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
exit "$rc"
