#!/usr/bin/env bash
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
pack() { tar -C $o -czf $B.tmp . && mv $B.tmp $B; }
kb() {  # name tuning bin args
  local name=$1 tun=$2 bin=$3; shift 3
  echo "=== $name tuning=$tun" >> $o/summary.log
  ( cd $o && ARFUSE_FUSION_TUNING=$tun timeout 150 $bin kernels --world=2 --json=$o/$name.json "$@" ) > $o/$name.log 2>&1
  echo "exit $?" >> $o/summary.log
  grep '^|' $o/$name.log | grep -v -- '---' | cut -d'|' -f2-8 >> $o/summary.log
  pack
}
T="--tokens=1,8,32,128 --hidden=4096,8192"
kb trace-ctl1 "" $PWD/bin-trace/arfuse-bench $T
kb trace-ctl0 "ctl=0" $PWD/bin-trace/arfuse-bench $T
S="--tokens=1,2,4,8,16,32,64,128,256 --hidden=4096,7168,8192"
for v in "ctl1a:" "ctl0a:ctl=0" "ctl1b:" "ctl0b:ctl=0"; do
  kb "ab-${v%%:*}" "${v#*:}" $PWD/bin/arfuse-bench $S
done
OUT=$o/corr BUNDLE= DB_LIMIT=150 ./gpu-run kernels doorbell multiproc > $o/corr.log 2>&1
pack
