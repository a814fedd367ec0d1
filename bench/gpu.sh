#!/usr/bin/env bash
# The GPU run (README "On an NVIDIA GPU"), as executed on the lent H200 through the `device` tool.
# Expects, in .device/: the kvsim binary and test binaries built on the dev machine, the mlx-cuda-13==0.32.2 wheel
# (reassembled from two parts: the first parked in /tmp/park by a previous call), the cp312 `mlx` and `mlx-lm`
# wheels (for the anchor). The anchor script is the checkout's bench/mlxlm_bench.py. Writes everything under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=/tmp/site
WHEEL=/tmp/mlx_cuda_13-0.32.2-py3-none-manylinux_2_35_x86_64.whl
if [ ! -d "$SITE/mlx/lib" ]; then
  cat /tmp/park/wheel.part1 .device/wheel.part2 > "$WHEEL" || exit 1
  sha256sum "$WHEEL" | tee "$OUT/wheel.sha256"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL" .device/mlx-0.32.2-cp312-*.whl .device/mlx_lm-*.whl || exit 1
  ln -sfn /opt/torch/.venv/lib/python3.12/site-packages/nvidia "$SITE/nvidia"
fi
export LD_LIBRARY_PATH=$SITE/mlx/lib PYTHONPATH=$SITE
# Test binaries were compiled with CARGO_MANIFEST_DIR=/work/main: make that path this checkout.
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
step() { echo "== $1 ($(date +%T))"; }
step doctor; .device/kvsim doctor 2>&1 | tee "$OUT/doctor.txt"
if [ "${RUN_TESTS:-1}" = 1 ]; then
  step tests
  for t in .device/tests/*; do timeout 240 "$t" --test-threads 2 2>&1 | tail -4; done | tee "$OUT/tests.txt"
fi
step sim; timeout "${SIM_TIMEOUT:-590}" .device/kvsim sim --device gpu --seeds "${SEEDS:-1000}" --time "${SIM_TIME:-560}" --json --out /tmp/failures > "$OUT/sim-gpu.log" 2>&1
tail -n 12 "$OUT/sim-gpu.log"; tail -n 1 "$OUT/sim-gpu.log" > "$OUT/sim-gpu.json"
if [ "${RUN_BENCH:-1}" = 1 ]; then
  step bench; .device/kvsim bench --device gpu --what "${BENCH_WHAT:-all}" --python python3 --anchor bench/mlxlm_bench.py --out "$OUT" 2>&1 | tail -12
fi
step done
