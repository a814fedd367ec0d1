#!/usr/bin/env bash
# `--gpus` on the lent GPU: the same 200 exact-mode seeds with and without `--gpus all`, which must give one
# result_hash. Run through the `device` tool in two back-to-back calls (one call carries at most 64 MiB):
#   park   keep .device/park/wheel.part1 (the first part of the mlx-cuda-13==0.32.2 wheel) in /tmp/park
#   run    reassemble and unpack the wheel beside a symlink `nvidia` to the machine's CUDA libraries, then
#          `kvsim sim --device gpu --exact-read --jobs 16 --seeds 200 --json`, without and with `--gpus all`
# Expects .device/run/kvsim (the release binary built here) and .device/run/wheel.part2. Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=/tmp/site
WHEEL=/tmp/mlx_cuda_13-0.32.2-py3-none-manylinux_2_35_x86_64.whl
case "${1:?stage}" in
park)
  mkdir -p /tmp/park && cp .device/park/* /tmp/park/ && ls -la /tmp/park
  ;;
run)
  cat /tmp/park/wheel.part1 .device/run/wheel.part2 > "$WHEEL" || exit 1
  sha256sum "$WHEEL" | tee "$OUT/wheel.sha256"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL" || exit 1
  ln -sfn /opt/torch/.venv/lib/python3.12/site-packages/nvidia "$SITE/nvidia"
  export LD_LIBRARY_PATH=$SITE/mlx/lib
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  for mode in plain gpus; do
    flag=""; [ $mode = gpus ] && flag="--gpus all"
    echo "== $mode ($(date +%T))"
    start=$(date +%s)
    # shellcheck disable=SC2086
    timeout -k 10 "${SIM_TIMEOUT:-270}" .device/run/kvsim sim --device gpu --exact-read $flag --jobs 16 --seeds 200 \
      --json --out /tmp/failures-$mode > "$OUT/sim-$mode.log" 2>&1
    echo "exit $? in $(( $(date +%s) - start )) s"
    grep -v '^{' "$OUT/sim-$mode.log" | tail -n 6; grep '^{' "$OUT/sim-$mode.log" | tail -n 1 > "$OUT/sim-$mode.json"
  done
  python3 - "$OUT" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/sim-{m}.json")) for m in ("plain", "gpus"))
print("result_hash plain", a["result_hash"], "gpus", b["result_hash"], "equal" if a["result_hash"] == b["result_hash"] else "DIFFER")
PY
  ;;
esac
