#!/usr/bin/env bash
# CPU measurements on the device machine's 16 cores: --jobs scaling, then a 1M-op soak started in the background
# (collected by .device/wait.sh in the next call).
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/mlx-cpu-0.32.2/mlx/lib
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nproc | tee $OUT/nproc.txt; lscpu | grep -i "model name" | tee -a $OUT/nproc.txt
SEEDS=${SEEDS:-1600}
now() { python3 -c 'import time;print(time.time())'; }
for rep in ${REPS:-1 2 3}; do
for j in ${JOBS:-1 2 4 8 16}; do
  s=$(now)
  .device/kvsim sim --seeds $SEEDS --jobs $j --json 2>/dev/null | tail -n 1 > $OUT/jobs-$j-$rep.json
  e=$(now)
  python3 -c "import json;d=json.load(open('$OUT/jobs-$j-$rep.json'));print('rep $rep jobs $j wall %.2f hash %s failures %s' % ($e-$s, d['result_hash'][:16], d['failures']))" | tee -a $OUT/jobs.txt
done; done
if [ -n "${SOAK_OPS:-}" ]; then
  mkdir -p /tmp/soak; cp .device/kvsim /tmp/soak/kvsim
  setsid nohup /tmp/soak/kvsim soak --ops $SOAK_OPS --json --out /tmp/soak/soak.json > /tmp/soak/log 2>&1 < /dev/null &
  echo "soak started pid $!"; sleep 3; pgrep -a kvsim
fi
