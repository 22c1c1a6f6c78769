#!/usr/bin/env bash
# Copies what the GPU tests and the benchmark need into one small folder that can travel to a
# GPU machine: the rank worker, the multi-process test, arfuse-bench (stripped) and the shared
# libraries the device image lacks (../shared/tools/bundle-libs).
# usage: tests/gpu/stage-for-device.sh [BUILD_DIR] [STAGE_DIR]
#   defaults: build-gpu, BUILD_DIR/stage
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-gpu}
stage=${2:-$build/stage}
bundle=${BUNDLE_LIBS:-$root/../shared/tools/bundle-libs}
rm -rf "$stage"
mkdir -p "$stage/bin"
cp "$build/tests/gpu/arfuse-gpu-rank" "$build/tests/gpu/arfuse_gpu_multiproc_test" \
   "$build/bench/arfuse-bench" "$stage/bin/"
strip "$stage"/bin/*
cp "$root/tests/gpu/run-on-device.sh" "$stage/"
(cd "$stage" && "$bundle" devlibs bin/*)
du -sh "$stage"
