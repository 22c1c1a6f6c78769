#!/usr/bin/env bash
# Eleventh session, call 5 (nvidia-h200-x2): the wedged-GPU case of calls 2-3 within ONE MPS
# daemon's life (gpu-run restarts the daemon per invocation, which is why call 4's demo passed):
# the multi-process test that wedges GPU 0 with a stuck NCCL kernel, then arfuse-demo (eager,
# 60 s limit) again and again, 5 s apart, until it passes or 150 s have gone; the MPS logs.
# Run from .devstage: ../.devpack/call5.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; S=$PWD; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d; sleep 1
timeout 120 $S/bin/arfuse_gpu_multiproc_test \
  --gtest_filter='*NcclAgreedOpNeverRunWedgesTheDevice*' > $o/wedge.log 2>&1
echo "wedge test exit $?" >> $o/summary.log
t0=$SECONDS
for i in $(seq 1 15); do
  ( cd $o && timeout 75 $S/bin/arfuse-demo --device=cuda --timeout=60 \
      --arfused=$S/bin/arfused ) > $o/demo$i.log 2>&1
  r=$?
  echo "demo attempt $i ended at +$((SECONDS - t0)) s: exit $r" >> $o/summary.log
  [ $r -eq 0 ] && break
  [ $((SECONDS - t0)) -gt 150 ] && break
  sleep 5
done
echo quit | nvidia-cuda-mps-control; sleep 1
cp -r $CUDA_MPS_LOG_DIRECTORY $o/mps-log
tar -C $o -czf $B.tmp . && mv $B.tmp $B
cat $o/summary.log
grep -h "exited with code\|sticky_device_error\|DevicesUnavailable\|shutdown_done" $o/demo1.log | cut -c1-220 | head -8
tail -n 20 $o/mps-log/server.log 2>/dev/null | cut -c1-200
