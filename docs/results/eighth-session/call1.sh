#!/usr/bin/env bash
# usage (from .devstage): ../.devpack/call1.sh OUTDIR BUNDLE
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
pack() { tar -C $o -czf $B.tmp . && mv $B.tmp $B; }
OUT=$o/corr BUNDLE= DB_LIMIT=150 ./gpu-run kernels doorbell multiproc > $o/corr.log 2>&1
pack
kb() {  # name tuning bin args
  local name=$1 tun=$2 bin=$3; shift 3
  echo "=== $name tuning=$tun" >> $o/summary.log
  ( cd $o && ARFUSE_FUSION_TUNING=$tun timeout 120 $bin kernels --world=2 --json=$o/$name.json "$@" ) > $o/$name.log 2>&1
  echo "exit $?" >> $o/summary.log
  grep '^|' $o/$name.log | grep -v -- '---' >> $o/summary.log
  pack
}
T="--tokens=1,8,32,128,1024 --hidden=4096,8192"
kb trace-def "" $PWD/bin-trace/arfuse-bench $T
grep '^trace' $o/trace-def.log >> $o/summary.log
kb trace-oc2 "opcheck=2" $PWD/bin-trace/arfuse-bench $T
grep '^trace' $o/trace-oc2.log >> $o/summary.log
W="--tokens=512,1024,2048 --hidden=4096,8192"
for v in "def:" "oc2:opcheck=2" "oc0:opcheck=0" "bo256:tight=4,backoff=256" "bo1000:tight=0,backoff=1000" "cps4:ctas_per_sm=4" "cps2:ctas_per_sm=2" "def2:"; do
  kb "bw-${v%%:*}" "${v#*:}" $PWD/bin/arfuse-bench $W
done
pack
