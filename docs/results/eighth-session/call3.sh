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
  grep '^|' $o/$name.log | grep -v -- '---' | cut -d'|' -f2-5 >> $o/summary.log
  pack
}
T="--tokens=1,8,32,128,1024 --hidden=4096,8192"
kb trace-warm1 "" $PWD/bin-trace/arfuse-bench $T
S="--tokens=1,2,4,8,16,32,64,128,256,1024 --hidden=4096,7168,8192"
for v in "w1a:" "w0a:warm=0" "w1b:" "w0b:warm=0"; do
  kb "ab-${v%%:*}" "${v#*:}" $PWD/bin/arfuse-bench $S
done
OUT=$o/corr BUNDLE= DB_LIMIT=150 ./gpu-run kernels doorbell multiproc > $o/corr.log 2>&1
pack
for v in w1a w0a w1b w0b; do grep '^|' $o/ab-$v.log | grep -v -- '---' | awk -F'|' '{print $5}' > $o/col-$v; done
grep '^|' $o/ab-w1a.log | grep -v -- '---' | awk -F'|' '{print $2,$3}' > $o/col-shape
paste $o/col-shape $o/col-w1a $o/col-w0a $o/col-w1b $o/col-w0b
grep -h "^trace" $o/trace-warm1.log | cut -c1-200
grep -h "=== .*exit\|PASSED\|FAILED" $o/corr.log | head -20
