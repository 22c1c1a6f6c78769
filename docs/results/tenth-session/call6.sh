#!/usr/bin/env bash
# Tenth session, call 6 (nvidia-h200-x4): world size 4, one rank per GPU, on the final build:
# arfuse-bench kernels --world=4 twice (the dispatcher's SM90 TP4 entry is vLLM's published
# gate until measured), then the multi-process GPU tests (world 4 one rank per GPU, world 8 two).
# Run from .devstage: ../.devpack/call6.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; S=$PWD; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
nvidia-smi topo -m > $o/topo.txt 2>&1
for r in 1 2; do
  echo "=== world 4 run $r" >> $o/summary.log
  ( cd $o && timeout 250 $S/bin/arfuse-bench kernels --world=4 --json=$o/w4-$r.json ) \
    > $o/w4-$r.log 2>&1
  echo "exit $?" >> $o/summary.log
  tar -C $o -czf $B.tmp . && mv $B.tmp $B
done
OUT=$o BUNDLE=$B ./gpu-run multiproc > $o/corr.log 2>&1
cat $o/summary.log $o/topo.txt
grep -h "^=== .*exit" $o/corr.log
grep -h "PASSED\|FAILED" $o/multiproc.log
grep '^|' $o/w4-1.log | cut -d'|' -f2-12 | head -40
