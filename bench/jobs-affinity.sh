#!/usr/bin/env bash
# Does pinning each worker to its own core change `--jobs` scaling? (run on the device machine's 16 cores)
# Each kvsim process runs two busy threads, its own and MLX's CPU stream thread, and hands work between them on every
# evaluation (1.27 cores per process measured on the dev machine). Compares, over the same seeds: one process
# (the baseline), N shards as N processes unpinned, the same N shards each pinned to one core (`taskset -c i`), and
# `kvsim sim --jobs N`. Wall and CPU seconds (bash `time`), REPS repetitions. Expects in $R: the release `kvsim`
# and the mlx-cpu==0.32.2 wheel. Writes $OUT/affinity.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=${R:-.device/aff}
SEEDS=${SEEDS:-600}  # 800 seeds: 240 s serial on the device host, too long for one 600 s call with the rest
if [ ! -d /tmp/mlxcpu/mlx/lib ]; then
  python3 -c "import zipfile,glob;zipfile.ZipFile(glob.glob('$R/mlx_cpu-*.whl')[0]).extractall('/tmp/mlxcpu')" || exit 1
fi
export LD_LIBRARY_PATH=/tmp/mlxcpu/mlx/lib
K=$R/kvsim
TIMEFORMAT='%R %U %S'
log() { echo "$*" | tee -a "$OUT/affinity.txt"; }
measure() { # label, command...
  local label=$1 t; shift
  t=$( { time "$@" > /dev/null 2>&1; } 2>&1 | tail -n 1 )
  log "$label wall/user/sys $t"
}
shards() { # N pinned?
  local n=$1 pin=$2 i
  for i in $(seq 0 $((n - 1))); do
    if [ "$pin" = 1 ]; then taskset -c "$i" "$K" sim --seeds "$SEEDS" --shard "$i/$n" --json > /dev/null 2>&1 &
    else "$K" sim --seeds "$SEEDS" --shard "$i/$n" --json > /dev/null 2>&1 & fi
  done
  wait
}
nproc | tee "$OUT/nproc.txt"
for rep in ${REPS:-1}; do
  measure "rep $rep serial" "$K" sim --seeds "$SEEDS" --json
  measure "rep $rep serial-pinned" taskset -c 0 "$K" sim --seeds "$SEEDS" --json
  for n in ${NS:-16}; do
    measure "rep $rep shards-$n-unpinned" shards "$n" 0
    measure "rep $rep shards-$n-pinned" shards "$n" 1
    measure "rep $rep jobs-$n" "$K" sim --seeds "$SEEDS" --jobs "$n" --json
  done
done
