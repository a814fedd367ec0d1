#!/usr/bin/env bash
# The closing GPU run (exact mode and the default mode, 1000 seeds each; the step and exact benches), as executed on
# the lent H200 through the `device` tool, in six back-to-back calls (the machine goes back after 30 s idle). Builds nothing there. Stages, one per call:
# SOAKS=0 skips the CPU soaks (and the mlx-cpu wheel they need).
#   park     keep the first part of the mlx-cuda-13==0.32.2 wheel and the mlx-cpu==0.32.2 wheel (.device/park/) in
#            /tmp/park (one call carries at most 64 MiB)
#   exact    reassemble and unpack the wheels; start two CPU soaks of 1M ops in the background (plain, and --trim),
#            on the CPU build of MLX; the exact-read check (bench --what exact); the simulator on the GPU in exact
#            mode (shard 0/2 of 1000 seeds, --jobs 16)
#   exact2   the second half of the exact-mode seeds (shard 1/2; `exact` runs shard 0/2)
#   default  the simulator on the GPU in the default (fused SDPA) mode, shard 0/2 of 1000 seeds, --jobs 16
#   default2 its shard 1/2 (merge the parts as for exact)
#   collect  stop the soaks (SIGINT: each still writes its report) unless they finished; fetch their reports; then
#            the decode step bench (fused and exact, alternating runs, mlx-lm in the same run)
# Expects in .device/run/ (stages exact, default): the release `kvsim` binary built on the dev machine, the second part
# of the CUDA wheel (`wheel.part2`), the cp312 `mlx` and `mlx-lm` 0.32.2 wheels (for the anchor). Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=${R:-.device/run}
SITE=/tmp/site CPU=/tmp/cpu
WHEEL=/tmp/mlx_cuda_13-0.32.2-py3-none-manylinux_2_35_x86_64.whl
step() { echo "== $1 ($(date +%T))"; }
install() {
  [ -d "$SITE/mlx/lib" ] && return 0
  cat /tmp/park/wheel.part1 "$R/wheel.part2" > "$WHEEL" || exit 1
  sha256sum "$WHEEL" | tee "$OUT/wheel.sha256"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL" "$R"/mlx-0.32.2-cp312-*.whl "$R"/mlx_lm-*.whl || exit 1
  ln -sfn /opt/torch/.venv/lib/python3.12/site-packages/nvidia "$SITE/nvidia"
  if [ "${SOAKS:-1}" != 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$CPU" /tmp/park/mlx_cpu-*.whl || exit 1
    mkdir -p /tmp/soak && cp "$R/kvsim" /tmp/soak/kvsim
  fi
}
# Half of the 1000 exact-mode seeds (shard I of 2; 983 seeds took 500 s in one call, too close to its 600 s limit).
# Merge the two parts where they land: `kvsim merge sim-exact-part-0.json sim-exact-part-1.json --json`.
exact_shard() {
  step "sim-exact shard $1/2"
  timeout -k 15 "${SIM_TIMEOUT:-540}" "$R/kvsim" sim --device gpu --exact-read --jobs 16 --seeds 1000 --shard "$1/2" --time "${SIM_TIME:-520}" --json --out /tmp/failures > "$OUT/sim-exact-$1.log" 2>&1
  grep -v '^{' "$OUT/sim-exact-$1.log" | tail -n 60 > "$OUT/sim-exact-tail-$1.txt"; tail -n 1 "$OUT/sim-exact-$1.log" > "$OUT/sim-exact-part-$1.json"
  rm -f "$OUT/sim-exact-$1.log"; tail -n 8 "$OUT/sim-exact-tail-$1.txt"
}
case "${1:?stage}" in
park)
  mkdir -p /tmp/park && cp .device/park/* /tmp/park/ && ls -la /tmp/park
  nproc; lscpu | grep -E "Model name|Thread|Core|Socket|^CPU\(s\)"
  ;;
exact)
  install
  step soaks
  [ "${SOAKS:-1}" != 0 ] && for mode in plain trim; do
    flag=""; [ $mode = trim ] && flag=--trim
    LD_LIBRARY_PATH=$CPU/mlx/lib setsid nohup /tmp/soak/kvsim soak --ops "${SOAK_OPS:-1000000}" $flag --json \
      --out /tmp/soak/soak-$mode.json > /tmp/soak/log-$mode 2>&1 < /dev/null &
  done
  sleep 2; pgrep -a kvsim
  export LD_LIBRARY_PATH=$SITE/mlx/lib PYTHONPATH=$SITE
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  step exact-check
  timeout -k 15 "${CHECK_TIMEOUT:-90}" "$R/kvsim" bench --device gpu --what exact --quick --out /tmp/bench-exact --json > "$OUT/exact-check.log" 2>&1
  grep -v '^{' "$OUT/exact-check.log" | tail -n 4; grep '^{' "$OUT/exact-check.log" | tail -n 1 > "$OUT/exact-check.json"
  exact_shard 0
  ;;
exact2)
  install
  export LD_LIBRARY_PATH=$SITE/mlx/lib PYTHONPATH=$SITE
  exact_shard 1
  ;;
default|default2)
  install
  export LD_LIBRARY_PATH=$SITE/mlx/lib PYTHONPATH=$SITE
  i=0; [ "$1" = default2 ] && i=1
  step "sim-default shard $i/2"
  timeout -k 15 "${SIM_TIMEOUT:-540}" "$R/kvsim" sim --device gpu --jobs 16 --seeds 1000 --shard "$i/2" --time "${SIM_TIME:-520}" --json --out /tmp/failures > "$OUT/sim-default-$i.log" 2>&1
  grep -v '^{' "$OUT/sim-default-$i.log" | tail -n 60 > "$OUT/sim-default-tail-$i.txt"; tail -n 1 "$OUT/sim-default-$i.log" > "$OUT/sim-default-part-$i.json"
  rm -f "$OUT/sim-default-$i.log"; tail -n 8 "$OUT/sim-default-tail-$i.txt"
  ;;
collect)
  install
  step soaks; pgrep -a kvsim
  for i in $(seq 1 "${WAIT_S:-120}"); do pgrep -f "kvsim soak" > /dev/null || break; sleep 1; done
  pkill -INT -f "kvsim soak"; sleep 5
  for mode in plain trim; do
    cp /tmp/soak/soak-$mode.json "$OUT/" 2>/dev/null; grep -v '^{' /tmp/soak/log-$mode | tail -n 5
  done
  export LD_LIBRARY_PATH=$SITE/mlx/lib PYTHONPATH=$SITE
  step step
  timeout -k 15 "${STEP_TIMEOUT:-300}" "$R/kvsim" bench --device gpu --what step --exact-read --python python3 --anchor bench/mlxlm_bench.py --out /tmp/bench-step --json > "$OUT/step.log" 2>&1
  grep -v '^{' "$OUT/step.log" | tail -n 9; grep '^{' "$OUT/step.log" | tail -n 1 > "$OUT/step.json"
  ;;
esac
step done
