#!/usr/bin/env bash
# Twelfth session, call 6 (nvidia-h200, one GPU, on call 5's stage, the final GPU code): the
# reliability suite (fault injection, then 20 s of sustained load through two sidecars).
# The device command, from the repository root:
cd .devstage && D=$OUT && mkdir -p /tmp/o/c6 && OUT=/tmp/o/c6 BUNDLE=$D/c6.tgz REL_LIMIT=330 ./gpu-run reliability > /tmp/o/c6/run.log 2>&1; grep -h "^=== .*exit" /tmp/o/c6/run.log; grep -h "PASSED\|FAILED\|ops=\|errors" /tmp/o/c6/reliability-fault.log /tmp/o/c6/reliability-load.log | tail -8; tar -C /tmp/o/c6 -czf $D/c6.tgz .
