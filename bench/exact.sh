#!/usr/bin/env bash
# The exact-read GPU run, as executed on the lent H200 through the `device` tool. Builds nothing there.
# Expects in .device/run/: the release `kvsim` binary built on the dev machine, the second part of the
# mlx-cuda-13==0.32.2 wheel (`wheel.part2`; the first part parked in /tmp/park by the call just before, see
# bench/gpu.sh), the cp312 `mlx` and `mlx-lm` 0.32.2 wheels (for the anchor), and the anchor script
# `mlxlm_bench.py`. Writes under $OUT:
#   exact-check.json  batch vs alone byte identity of the exact read and of MLX's fused SDPA, accuracy (bench --what exact)
#   step.json         the decode step, fused and exact, alternating runs, with mlx-lm in the same run (bench --what step --exact-read)
#   sim-exact.json    the simulator on the GPU in exact mode (last JSON line)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=${R:-.device/run}
SITE=/tmp/site
WHEEL=/tmp/mlx_cuda_13-0.32.2-py3-none-manylinux_2_35_x86_64.whl
if [ ! -d "$SITE/mlx/lib" ]; then
  cat /tmp/park/wheel.part1 "$R/wheel.part2" > "$WHEEL" || exit 1
  sha256sum "$WHEEL" | tee "$OUT/wheel.sha256"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL" "$R"/mlx-0.32.2-cp312-*.whl "$R"/mlx_lm-*.whl || exit 1
  ln -sfn /opt/torch/.venv/lib/python3.12/site-packages/nvidia "$SITE/nvidia"
fi
export LD_LIBRARY_PATH=$SITE/mlx/lib PYTHONPATH=$SITE
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
step() { echo "== $1 ($(date +%T))"; }
step exact-check
timeout "${CHECK_TIMEOUT:-200}" "$R/kvsim" bench --device gpu --what exact ${CHECK_QUICK:+--quick} --out /tmp/bench-exact --json > "$OUT/exact-check.log" 2>&1
grep -v '^{' "$OUT/exact-check.log" | tail -n 5; grep '^{' "$OUT/exact-check.log" | tail -n 1 > "$OUT/exact-check.json"
step step
timeout "${STEP_TIMEOUT:-240}" "$R/kvsim" bench --device gpu --what step --exact-read ${QUICK:+--quick} --python python3 --anchor "$R/mlxlm_bench.py" --out /tmp/bench-step --json > "$OUT/step.log" 2>&1
grep -v '^{' "$OUT/step.log" | tail -n 9; grep '^{' "$OUT/step.log" | tail -n 1 > "$OUT/step.json"
step sim
timeout "${SIM_TIMEOUT:-120}" "$R/kvsim" sim --device gpu --exact-read ${JOBS:+--jobs $JOBS} --seeds "${SEEDS:-1000}" --time "${SIM_TIME:-100}" --json --out /tmp/failures > "$OUT/sim-exact.log" 2>&1
tail -n 14 "$OUT/sim-exact.log" | grep -v '^{'; tail -n 1 "$OUT/sim-exact.log" > "$OUT/sim-exact.json"
step done
