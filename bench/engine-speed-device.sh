#!/usr/bin/env bash
# Engine checks per second on a machine with many cores and no network (the lent device machine's CPUs): an old
# kvsim against this tree's with 1 to 12 engines side by side (`check-engine --jobs`), on equal work, through
# bench/check-engine-speed.sh.
#
#   bench/engine-speed-device.sh bundle OLD_KVSIM OLD_COMMIT   # here: .device/espeed (binaries, wheels, old engine)
#   bench/engine-speed-device.sh run [SEEDS] [RUNS]            # there, from the repository root; into $OUT
#
# `bundle` strips and compresses both binaries, downloads mlx, mlx-cpu and mlx-lm 0.32.2 for CPython 3.12 and
# extracts OLD_COMMIT's engine and kit (about 20 MB in all; carry `.device/espeed`). `run` makes
# oracles/mlx_lm/.venv from the wheels alone (unzipped: no pip, no network) with PY (default the machine's
# /opt/torch/.venv/bin/python3), points the binaries at the wheel's libmlx, and writes one folder per JOBS value
# (JOBS, default "1 4 8 12") under OUT, each with check-engine-speed.sh's logs and its table in summary.txt. PIN_AB
# (e.g. "1 4"): then, for each of those JOBS values, the new binary with its workers unpinned (`KVSIM_PIN_CPUS=off`,
# as "old") against itself pinned (the default), into OUT/pin-ab-jobs-J.
set -euo pipefail
cd "$(dirname "$0")/.."
B=.device/espeed
case "${1:-run}" in
bundle)
  old_kvsim=${2:?old kvsim binary}; old_commit=${3:?old commit}
  rm -rf "$B"; mkdir -p "$B/wheels" "$B/old"
  cargo build --release --quiet --bin kvsim
  strip -o "$B/kvsim-new" target/release/kvsim; strip -o "$B/kvsim-old" "$old_kvsim"
  xz -T2 "$B/kvsim-new" "$B/kvsim-old"
  pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_35_x86_64 \
    -d "$B/wheels" mlx==0.32.2 mlx-cpu==0.32.2 mlx-lm==0.32.2
  git archive "$old_commit" python oracles/mlx_lm/engine.py | tar -x -C "$B/old"
  echo "$old_commit" > "$B/old-commit"
  du -sh "$B" ;;
run)
  seeds=${2:-200}; runs=${3:-3}; out=${OUT:?the folder that comes back}
  py=${PY:-/opt/torch/.venv/bin/python3}
  venv=oracles/mlx_lm/.venv
  rm -rf "$venv"; "$py" -m venv --without-pip "$venv"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for w in "$B"/wheels/*.whl; do "$venv/bin/python" -m zipfile -e "$w" "$site"; done
  for b in new old; do xz -dkf "$B/kvsim-$b.xz"; chmod +x "$B/kvsim-$b"; done
  export LD_LIBRARY_PATH="$site/mlx/lib" PATH="$PWD/$venv/bin:$PATH"  # purelib is an absolute path
  { nproc; grep -m1 'model name' /proc/cpuinfo; "$venv/bin/python" -c 'import mlx.core as mx; print(mx.__version__)'
  } | tee "$out/machine.txt"
  for j in ${JOBS:-1 4 8 12}; do
    mkdir -p "$out/jobs-$j"
    OUT="$out/jobs-$j" NEW_KVSIM="$B/kvsim-new" NEW_ARGS="--jobs $j" OLD_DIR="$B/old" OLD_ARGS="--only kv" \
      bench/check-engine-speed.sh "$B/kvsim-old" "$(cat "$B/old-commit")" "$seeds" "$runs" \
      | tee "$out/jobs-$j/summary.txt"
  done
  cur=$(mktemp -d); mkdir -p "$cur/oracles/mlx_lm"; cp -r python "$cur/"; cp oracles/mlx_lm/engine.py "$cur/oracles/mlx_lm/"
  printf '#!/bin/sh\nKVSIM_PIN_CPUS=off exec "%s" "$@"\n' "$PWD/$B/kvsim-new" > "$B/kvsim-unpinned"
  chmod +x "$B/kvsim-unpinned"
  for j in ${PIN_AB:-}; do
    mkdir -p "$out/pin-ab-jobs-$j"
    OUT="$out/pin-ab-jobs-$j" NEW_KVSIM="$B/kvsim-new" NEW_ARGS="--jobs $j" OLD_DIR="$cur" OLD_ARGS="--only kv --jobs $j" \
      bench/check-engine-speed.sh "$B/kvsim-unpinned" HEAD "$seeds" "$runs" | tee "$out/pin-ab-jobs-$j/summary.txt"
  done ;;
*) echo "usage: $0 bundle OLD_KVSIM OLD_COMMIT | run [SEEDS] [RUNS]" >&2; exit 2 ;;
esac
