#!/usr/bin/env bash
# Installs the kvsim wheel into a fresh venv in a pristine environment (empty HOME and caches, PATH=/usr/bin:/bin: no
# Rust toolchain, pip takes binary wheels only) and checks it end to end (docs/python.md, "Testing the wheel"):
#   1. the wheel's size and `pip install` time (every dependency downloaded: the pip cache is empty);
#   2. `kvsim doctor` (must end `mlx 0.32.2 cpu ok`, libmlx.so loaded from the venv), `kvsim sim --seeds 20`;
#   3. mlx-lm 0.32.2 `--no-deps` into the venv; `kvsim check-engine --driver "python -m kvsim.drivers.mlx_lm"
#      --seeds 50` must give the same classes as the repository's run (`python3 oracles/mlx_lm/engine.py`, run
#      first, outside the pristine environment, by REPO_KVSIM: default `cargo run --release --`);
#   4. pytest + vllm-mlx 0.6.0 `--no-deps`; the kvsim_check fixture (python/tests/pytest-fixture/) must pass
#      test_pass.py, fail both tests of test_fail.py (findings) and of test_broke.py (an engine that breaks).
#
#   python/test-wheel.sh [WHEEL] [LOG_DIR]     # defaults: target/wheels/kvsim-*.whl, bench/results/wheel
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WHEEL=$(realpath "${1:-$(ls target/wheels/kvsim-*.whl | head -n 1)}")
LOG=$(realpath -m "${2:-bench/results/wheel}")
SEEDS=${SEEDS:-50}

if [ -z "${KVSIM_TEST_WHEEL_INNER:-}" ]; then
  mkdir -p "$LOG"
  {
    echo "== $(date -u +%FT%TZ) test-wheel: $(basename "$WHEEL") on $(uname -srm), $(nproc) cores"
    echo "== the repository's run: check-engine over python3 oracles/mlx_lm/engine.py, $SEEDS seeds"
    bash oracles/mlx_lm/setup.sh
    repo_out=$(mktemp -d)
    ${REPO_KVSIM:-cargo run --release --} check-engine --driver "python3 oracles/mlx_lm/engine.py" --seeds "$SEEDS" \
      --out "$repo_out" --json > "$LOG/repo-check-engine.log" 2>&1
    echo "exit $? (expected 1: mlx-lm's upstream classes)"; grep -v '^{' "$LOG/repo-check-engine.log"
    tail -n 1 "$LOG/repo-check-engine.log" > "$LOG/repo-check-engine.json"
  } 2>&1 | tee "$LOG/test-wheel.log"
  home=$(mktemp -d)
  env -i HOME="$home" PATH=/usr/bin:/bin LANG=C.UTF-8 TMPDIR="$home/tmp" KVSIM_TEST_WHEEL_INNER=1 SEEDS="$SEEDS" \
    bash "$0" "$WHEEL" "$LOG" 2>&1 | tee -a "$LOG/test-wheel.log"
  rc=${PIPESTATUS[0]}
  rm -rf "$home"
  exit "$rc"
fi

# ---- inside the pristine environment ----
mkdir -p "$TMPDIR"
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAILED: $1"; fail=1; fi; }
echo "== pristine: HOME=$HOME PATH=$PATH; env: $(env | cut -d= -f1 | sort | tr '\n' ' ')"
echo "cargo: $(command -v cargo || echo 'not on PATH')  rustc: $(command -v rustc || echo 'not on PATH')  python3: $(command -v python3) $(python3 --version 2>&1)"
ls "$HOME"/.cache 2> /dev/null && echo "(a cache exists)" || echo "caches: none (empty HOME)"
size=$(stat -c %s "$WHEEL")
echo "wheel: $(basename "$WHEEL") $size bytes ($(awk "BEGIN{printf \"%.1f\", $size/1048576}") MiB)"

# Three fresh venvs, each installed with no pip cache (every dependency downloaded); the first is used below.
times=""
for i in 1 2 3; do
  v=$HOME/somewhere/else/venv$i
  t0=$(date +%s.%N); python3 -m venv "$v"; t1=$(date +%s.%N)
  echo "== venv $i: python3 -m venv $v ($(awk "BEGIN{printf \"%.1f\", $t1-$t0}") s); pip install $(basename "$WHEEL") (binary wheels only, no pip cache)"
  t0=$(date +%s.%N)
  "$v/bin/python" -m pip install --disable-pip-version-check --no-cache-dir --only-binary=:all: "$WHEEL" 2>&1 | grep -v '^ *[━-]'
  t1=$(date +%s.%N)
  s_=$(awk "BEGIN{printf \"%.1f\", $t1-$t0}"); times+="${times:+ }$s_"
  echo "install $i: $s_ s"
done
install_s=${times%% *}
echo "install times (s): $times"
V=$HOME/somewhere/else/venv1
. "$V/bin/activate"
echo "installed: $(du -sh "$V" | cut -f1) venv; kvsim binary $(du -h "$V/bin/kvsim" | cut -f1), mlx $(du -sh "$V"/lib/python3*/site-packages/mlx | cut -f1)"
cd "$TMPDIR"  # away from the checkout: nothing below may import from it
python -m pip list --disable-pip-version-check 2> /dev/null | grep -iE '^(kvsim|mlx)'
echo "kvsim on PATH: $(command -v kvsim)"

echo "== kvsim doctor"
kvsim doctor 2>&1 | tee "$TMPDIR/doctor.log"
check "doctor ends 'mlx 0.32.2 cpu ok'" '[ "$(tail -n 1 "$TMPDIR/doctor.log")" = "mlx 0.32.2 cpu ok" ]'
check "libmlx.so is the venv's" 'grep -q "$V/lib/python3[.0-9]*/site-packages/mlx/lib/libmlx.so" "$TMPDIR/doctor.log"'
echo "== kvsim sim --seeds 20"
t0=$(date +%s.%N)
kvsim sim --seeds 20 --out "$TMPDIR/failures" 2>&1 | grep -v '^\s*$' | tail -n 14
sim_rc=${PIPESTATUS[0]}
echo "sim: exit $sim_rc in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N)-$t0}") s"
check "sim passes" '[ "$sim_rc" = 0 ]'
echo "== the README's run command, from the wheel: kvsim sim (100 seeds)"
t0=$(date +%s.%N)
kvsim sim --out "$TMPDIR/failures" 2>&1 | grep '^kvsim sim:'
echo "kvsim sim (100 seeds): $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N)-$t0}") s"
echo "== python -m kvsim doctor (the LD_LIBRARY_PATH shim) ends the same"
check "python -m kvsim doctor" '[ "$(python -m kvsim doctor 2>&1 | tail -n 1)" = "mlx 0.32.2 cpu ok" ]'

echo "== pip install --target (a layout the run path does not cover): python -m kvsim still runs the binary"
python -m pip install --disable-pip-version-check --only-binary=:all: -q --no-deps --target "$TMPDIR/tgt" "$WHEEL"
"$TMPDIR/tgt/bin/kvsim" doctor 2>&1 | tail -n 1
PYTHONPATH=$TMPDIR/tgt python -c "from kvsim import _bin; print('python -m kvsim runs', _bin.binary())"
PYTHONPATH=$TMPDIR/tgt python -m kvsim doctor 2>&1 | sed -n '2p;$p'
check "--target: python -m kvsim doctor" '[ "$(PYTHONPATH=$TMPDIR/tgt python -m kvsim doctor 2>&1 | tail -n 1)" = "mlx 0.32.2 cpu ok" ]'
echo "== mlx-lm 0.32.2 --no-deps; kvsim check-engine --driver \"python -m kvsim.drivers.mlx_lm\" --seeds $SEEDS"
python -m pip install --disable-pip-version-check --only-binary=:all: -q --no-deps mlx-lm==0.32.2
python -c "import kvsim.drivers.mlx_lm as m; print('driver module:', m.__file__)"
t0=$(date +%s.%N)
kvsim check-engine --driver "python -m kvsim.drivers.mlx_lm" --seeds "$SEEDS" --out "$TMPDIR/ce" --json > "$TMPDIR/ce.log" 2>&1
ce_rc=$?
grep -v '^{' "$TMPDIR/ce.log"
echo "check-engine: exit $ce_rc in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N)-$t0}") s"
tail -n 1 "$TMPDIR/ce.log" > "$LOG/wheel-check-engine.json"
classes() { python -c "import json,sys; s=json.load(open(sys.argv[1])); print(' '.join(c['name']+':'+','.join(map(str,c['failing_seeds'])) for c in s['classes']))" "$1"; }
echo "classes (wheel): $(classes "$LOG/wheel-check-engine.json")"
echo "classes (repo):  $(classes "$LOG/repo-check-engine.json")"
check "same classes and failing seeds as the repository's run" \
  '[ "$(classes "$LOG/wheel-check-engine.json")" = "$(classes "$LOG/repo-check-engine.json")" ]'
check "the reproducers were written" 'ls "$TMPDIR"/ce/*.py > /dev/null'
echo "-- python $TMPDIR/ce/rows_vs_solo.py (the reproducer written from the installed driver, standalone)"
python "$TMPDIR/ce/rows_vs_solo.py"; repro_rc=$?
check "the reproducer exits 1 while the divergence is there" '[ "$repro_rc" = 1 ]'

echo "== pytest and vllm-mlx 0.6.0 --no-deps; the kvsim_check fixture"
python -m pip install --disable-pip-version-check --only-binary=:all: -q pytest
python -m pip install --disable-pip-version-check --only-binary=:all: -q --no-deps vllm-mlx==0.6.0
proj=$TMPDIR/engine-repo && mkdir -p "$proj" && cp "$REPO"/python/tests/pytest-fixture/test_*.py "$proj/"
cd "$proj"
echo "-- python -m pytest test_pass.py --kvsim-seeds 100 --kvsim-out kvsim-out (expected: passes)"
python -m pytest -p no:cacheprovider -rA test_pass.py --kvsim-seeds 100 --kvsim-out kvsim-out 2>&1 | tail -n 8
pass_rc=${PIPESTATUS[0]}
echo "kept: $(cd kvsim-out && find . -type f | sort | tr '\n' ' ')"
echo "-- pytest test_fail.py (expected: both tests fail)"
python -m pytest -p no:cacheprovider test_fail.py 2>&1 | sed -n '/= FAILURES =/,$p'
fail_rc=${PIPESTATUS[0]}
check "test_pass.py passes" '[ "$pass_rc" = 0 ]'
check "--kvsim-out kept the known classes' reproducers" 'ls kvsim-out/*/*.py > /dev/null'
check "test_fail.py fails" '[ "$fail_rc" = 1 ]'
quiet=$(python -m pytest -p no:cacheprovider -q test_fail.py 2>&1 | tail -n 1)
check "both tests of test_fail.py fail ($quiet)" '[[ "$quiet" == "2 failed"* ]]'

echo "-- pytest test_broke.py (expected: both tests fail, each saying why)"
python -m pytest -p no:cacheprovider test_broke.py 2>&1 | sed -n '/= FAILURES =/,$p' | tee "$TMPDIR/broke.log"
check "test_broke.py: the engine broke" 'grep -q "the engine broke \[exited\]" "$TMPDIR/broke.log"'
check "test_broke.py: past time_limit" 'grep -q "ran past time_limit=1s" "$TMPDIR/broke.log"'
check "test_broke.py: 2 failed" 'tail -n 1 "$TMPDIR/broke.log" | grep -q "2 failed"'

echo "== summary: wheel $size bytes, installs ${times} s, $( [ $fail = 0 ] && echo 'all checks passed' || echo 'SOME CHECKS FAILED')"
exit $fail
