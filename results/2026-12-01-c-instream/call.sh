#!/usr/bin/env bash
# Unpacks the staged binaries (stage.tar.gz beside this script, from scripts/gpu-stage), then runs
# the named measurements in order (arguments) through scripts/gpu-run.
set -u
here=$(cd "$(dirname "$0")" && pwd)
cd "$here" && tar xzf stage.tar.gz || exit 1
export OUT=${OUT:-$here/out} BUNDLE=${OUT:-$here/out}/logs.tgz
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, grpc, google.protobuf, numpy; print("torch", torch.__version__, "grpc", grpc.__version__)' || true
L8B="--hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336 --vocab 32000 --prompt-len 32"
L70="--hidden 8192 --heads 64 --kv-heads 8 --intermediate 28672 --vocab 32000 --prompt-len 32"
rc=0
for step in "$@"; do
  echo "##### $step"
  case $step in
    instream) "$here/gpu-run" instream ;;
    kernels) "$here/gpu-run" kernels ;;
    demo) "$here/gpu-run" demo ;;
    doorbell) "$here/gpu-run" doorbell ;;
    small) TP_NAME=small "$here/gpu-run" tp ;;
    8b-b16) TP_NAME=8b-b16 TP_LIMIT=240 TP_ARGS="$L8B --layers 32 --batch 16" "$here/gpu-run" tp ;;
    8b-b1) TP_NAME=8b-b1 TP_LIMIT=200 TP_ARGS="$L8B --layers 32 --batch 1" "$here/gpu-run" tp ;;
    8b-b64) TP_NAME=8b-b64 TP_LIMIT=240 TP_ARGS="$L8B --layers 32 --batch 64" "$here/gpu-run" tp ;;
    8b-l80) TP_NAME=8b-l80 TP_LIMIT=300 TP_ARGS="$L8B --layers 80 --batch 16" "$here/gpu-run" tp ;;
    8b-l4) TP_NAME=8b-l4 TP_LIMIT=120 TP_ARGS="$L8B --layers 4 --batch 16" "$here/gpu-run" tp ;;
    8b-l8) TP_NAME=8b-l8 TP_LIMIT=120 TP_ARGS="$L8B --layers 8 --batch 16" "$here/gpu-run" tp ;;
    8b-l12) TP_NAME=8b-l12 TP_LIMIT=120 TP_ARGS="$L8B --layers 12 --batch 16" "$here/gpu-run" tp ;;
    70b-b1) TP_NAME=70b-b1 TP_LIMIT=150 TP_ARGS="$L70 --layers 8 --batch 1" "$here/gpu-run" tp ;;
    70b-b64) TP_NAME=70b-b64 TP_LIMIT=150 TP_ARGS="$L70 --layers 8 --batch 64" "$here/gpu-run" tp ;;
    70b-b16) TP_NAME=70b-b16 TP_LIMIT=240 TP_ARGS="$L70 --layers 8 --batch 16" "$here/gpu-run" tp ;;
    # The budget before serving blocks counted ((132 - 2 x 2 - 2) / 2 SMs): the prefill failure.
    db-l8-old) ARFUSE_SM_BUDGET=63 TP_NAME=db-l8-old TP_LIMIT=120 TP_ARGS="$L8B --layers 8 --batch 16 --plane doorbell" "$here/gpu-run" tp ;;
    db-l8) TP_NAME=db-l8 TP_LIMIT=200 TP_ARGS="$L8B --layers 8 --batch 16 --plane doorbell" "$here/gpu-run" tp ;;
    kill) TP_NAME=kill TP_SCENARIOS=off,kill TP_LIMIT=150 "$here/gpu-run" tp ;;
    oracle) ORACLE_LIMIT=300 ORACLE_ARGS="--timeout 280" "$here/gpu-run" oracle ;;
    bench) BENCH_LIMIT=300 "$here/gpu-run" sidecar ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  [ $? -eq 0 ] || rc=1
done
exit $rc
