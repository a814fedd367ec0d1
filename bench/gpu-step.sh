#!/usr/bin/env bash
# The decode step against its copy roofline on the lent GPU, old binary against new in the same call, with the parts
# of the step timed alone on MLX's Python API (bench/step_profile.py). Three back-to-back calls through the `device`
# tool (one call carries at most 64 MiB with the working tree; the machine goes back after 30 s idle). Builds nothing
# there.
#   park   PARK=.device/park1, then PARK=.device/park2: carry each half of the mlx-cuda-13==0.32.2 wheel
#          (wheel.part1, wheel.part2), kept in /tmp/park
#   step   carry .device/run/: the cp312 mlx and mlx-lm 0.32.2 wheels (for the anchor and the profile), kvsim-old.xz
#          and kvsim-new.xz (stripped release binaries, xz-compressed); runs the profile, then
#          `kvsim bench --device gpu --what step --exact-read` of each binary, new, old, new (mlx-lm in every run);
#          SIM_SEEDS=N then runs the new binary's simulator on the GPU in the default mode over N seeds
# Splitting the wheel: split -b 44000000 -d WHEEL /tmp/wp (wp00 -> park1/wheel.part1, wp01 -> park2/wheel.part2).
# Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=${R:-.device/run}
SITE=/tmp/site
WHEEL=/tmp/mlx_cuda_13-0.32.2-py3-none-manylinux_2_35_x86_64.whl
step() { echo "== $1 ($(date +%T))"; }
case "${1:?stage}" in
park)
  mkdir -p /tmp/park && cp "${PARK:?PARK=.device/park1 or .device/park2}"/* /tmp/park/ && ls -la /tmp/park
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  ;;
step)
  cat /tmp/park/wheel.part1 /tmp/park/wheel.part2 > "$WHEEL" || exit 1
  sha256sum "$WHEEL" | tee "$OUT/wheel.sha256"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL" "$R"/mlx-0.32.2-cp312-*.whl "$R"/mlx_lm-*.whl || exit 1
  ln -sfn /opt/torch/.venv/lib/python3.12/site-packages/nvidia "$SITE/nvidia"
  for b in old new; do xz -dc "$R/kvsim-$b.xz" > /tmp/kvsim-$b && chmod +x /tmp/kvsim-$b; done
  export LD_LIBRARY_PATH=$SITE/mlx/lib PYTHONPATH=$SITE
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  if [ "${PROFILE:-1}" != 0 ]; then
    step profile
    timeout -k 10 "${PROFILE_TIMEOUT:-150}" python3 bench/step_profile.py --json "$OUT/step-profile.json" 2>&1 | tail -n 6
  fi
  for b in ${ORDER:-new old new}; do
    step "step $b"
    n=$(ls "$OUT" | grep -c "^step-$b")
    timeout -k 10 "${STEP_TIMEOUT:-200}" /tmp/kvsim-$b bench --device gpu --what step --exact-read --python python3 \
      --anchor bench/mlxlm_bench.py --out /tmp/bench-step --json > /tmp/step.log 2>&1
    grep -v '^{' /tmp/step.log | tail -n 8; grep '^{' /tmp/step.log | tail -n 1 > "$OUT/step-$b-$n.json"
  done
  if [ "${SIM_SEEDS:-0}" != 0 ]; then
    step "sim default mode, $SIM_SEEDS seeds, new"
    timeout -k 10 "${SIM_TIMEOUT:-150}" /tmp/kvsim-new sim --device gpu --jobs 16 --seeds "$SIM_SEEDS" --time "${SIM_TIME:-130}" \
      --json --out /tmp/failures > /tmp/sim.log 2>&1
    grep -v '^{' /tmp/sim.log | tail -n 6; tail -n 1 /tmp/sim.log > "$OUT/sim-default-$SIM_SEEDS.json"
  fi
  ;;
esac
step done
