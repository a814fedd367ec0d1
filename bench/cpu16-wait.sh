#!/usr/bin/env bash
OUT=${OUT:-/tmp/out}
pgrep -a kvsim || echo "no soak process"
for i in $(seq 1 ${WAIT:-570}); do pgrep -f "kvsim soak" >/dev/null || break; sleep 1; done
cp /tmp/soak/soak.json $OUT/ 2>/dev/null; tail -c 2000 /tmp/soak/log | tr '\r' '\n' | tail -n 8
