#!/usr/bin/env bash
# Poll-load A/B (knob poll=0 volatile, 1 relaxed.gpu, 2 cg), then the tests with the winner's
# builds (v1/, v2/: the same code with that poll as the default).
set -uo pipefail
o=$1; B=$2; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/devlibs:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
pack() { tar -C $o -czf $B.tmp . && mv $B.tmp $B; }
S="--tokens=1,2,8,32,128,1024 --hidden=4096,8192"
bench=$PWD/bin/arfuse-bench
for r in a b; do for p in 0 1 2; do
  ( cd $o && ARFUSE_FUSION_TUNING=poll=$p timeout 120 $bench kernels --world=2 --json=$o/ab-p$p$r.json $S ) > $o/ab-p$p$r.log 2>&1
  echo "ab-p$p$r exit $?" >> $o/summary.log
done; done
pack
python3 - $o > $o/winner.txt <<'PY'
import json,sys
o=sys.argv[1]
def rows(n): return {(r['hidden'],r['tokens']):r['oneshot'] for r in json.load(open(n))['rows']}
tot={}
for p in (0,1,2):
  a=rows(f'{o}/ab-p{p}a.json'); b=rows(f'{o}/ab-p{p}b.json')
  for k in sorted(a): print(p,k,a[k],b[k],file=sys.stderr)
  tot[p]=sum((a[k]+b[k])/2 for k in a)
w=min(tot,key=tot.get)
if tot[0]-tot[w] < 1.0: w=0
print(w)
print(tot,file=sys.stderr)
PY
w=$(cat $o/winner.txt); echo "winner poll=$w" >> $o/summary.log
for p in 0 1 2; do paste <(grep '^|' $o/ab-p${p}a.log | cut -d'|' -f2,3,5) <(grep '^|' $o/ab-p${p}b.log | cut -d'|' -f5) | sed "s/^/p$p /" >> $o/summary.log; done
if [ -n "$w" ] && [ "$w" != 0 ]; then
  cp v$w/* bin/
  OUT=$o/v BUNDLE= DB_LIMIT=150 ./gpu-run kernels doorbell bench sidecar multiproc > $o/v.log 2>&1
  grep -h "^=== .*exit" $o/v.log >> $o/summary.log
  grep -h "PASSED\|FAILED" $o/v/kernels.log $o/v/doorbell.log $o/v/multiproc.log >> $o/summary.log
fi
pack
cat $o/summary.log
