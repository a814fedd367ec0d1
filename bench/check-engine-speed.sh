#!/usr/bin/env bash
# Engine checks per second: an old kvsim with its mlx-lm engine against this tree's, on equal work (the K/V swarm
# against mlx-lm 0.32.2, `--only kv` on the new side), alternating runs, medians and spread.
#
#   bench/check-engine-speed.sh OLD_KVSIM OLD_COMMIT [SEEDS] [RUNS]     # defaults: 200 seeds, 3 runs each
#
# OLD_KVSIM is a binary built from OLD_COMMIT; the old engine is OLD_COMMIT's oracles/mlx_lm/engine.py (with its
# python/ driver kit, where it has one), run in this tree's oracles/mlx_lm/.venv. Environment: NEW_KVSIM (default: a
# release build of this tree; give a binary of the same profile as OLD_KVSIM), OLD_ARGS (extra arguments of the old
# side, e.g. `--only kv` for an old kvsim that has it), NEW_ARGS (extra arguments of the new side, e.g. `--jobs 2`),
# OUT (default bench/results/check-engine-speed). Each run's log
# goes to OUT; the table and whether both sides found the same classes on the same seeds are printed at the end.
# OLD_DIR: a folder holding OLD_COMMIT's oracles/mlx_lm/engine.py and python/ (instead of `git archive`).
# PAIRED=1 runs each old run and its new run at the same time (both under the same load from other work) instead of
# one after the other. Each run also has its CPU time (bench/engine-cpu.py: kvsim's processes and the engine's, sampled from /proc) in
# OUT/cpu.txt: on a machine shared with other work the wall time measures the load as much as the run.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?old kvsim binary}; COMMIT=${2:?old commit}; SEEDS=${3:-200}; RUNS=${4:-3}
OUT=${OUT:-bench/results/check-engine-speed}; mkdir -p "$OUT"
NEW=${NEW_KVSIM:-target/release/kvsim}
[ -n "${NEW_KVSIM:-}" ] || cargo build --release --quiet --bin kvsim || exit 2
bash oracles/mlx_lm/setup.sh >/dev/null || exit 2
old_dir=$(mktemp -d); trap 'rm -rf "$old_dir"' EXIT
if [ -n "${OLD_DIR:-}" ]; then  # the old engine and kit already extracted (a machine without the git history)
  cp -r "$OLD_DIR"/. "$old_dir"/
else
  paths=(oracles/mlx_lm/engine.py); git cat-file -e "$COMMIT:python" 2>/dev/null && paths+=(python)
  git archive "$COMMIT" "${paths[@]}" | tar -x -C "$old_dir" || exit 2
fi
ln -s "$PWD/oracles/mlx_lm/.venv" "$old_dir/oracles/mlx_lm/.venv"
read -ra old_args <<< "${OLD_ARGS:-}"
read -ra new_args <<< "${NEW_ARGS:-}"
run() { # side i
  local side=$1 i=$2 cmd start

  if [ "$side" = old ]; then
    cmd=("$OLD" check-engine --driver "python3 $old_dir/oracles/mlx_lm/engine.py" "${old_args[@]}")
  else
    cmd=("$NEW" check-engine --driver "python3 oracles/mlx_lm/engine.py" --only kv "${new_args[@]}")
  fi
  start=$(date +%s%N)
  python3 bench/engine-cpu.py "$OUT/cpu-$side-$i.txt" "${cmd[@]}" --seeds "$SEEDS" --json --out "$OUT/$side-$i" \
    > "$OUT/$side-$i.log" 2>&1
  echo "$(( ($(date +%s%N) - start) / 1000000 ))" > "$OUT/wall-$side-$i.txt"
}
for i in $(seq 1 "$RUNS"); do
  if [ "${PAIRED:-0}" = 1 ]; then
    run old "$i" & run new "$i"; wait
  else
    run old "$i"; run new "$i"
  fi
  for side in old new; do
    echo "$side $i $(cat "$OUT/wall-$side-$i.txt")" >> "$OUT/times.txt"
    echo "$side $i $(cat "$OUT/cpu-$side-$i.txt")" >> "$OUT/cpu.txt"
    rm -f "$OUT/wall-$side-$i.txt" "$OUT/cpu-$side-$i.txt"
  done
done
python3 - "$OUT" "$RUNS" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
times = {}
for line in open(f"{out}/times.txt").read().split("\n")[-2 * runs - 1:]:
    if line.strip():
        side, i, ms = line.split()
        times.setdefault(side, []).append(int(ms) / 1000)
def summary(side, i):
    lines = [l for l in open(f"{out}/{side}-{i}.log") if l.startswith("{")]
    return json.loads(lines[-1])
s = {side: summary(side, 1) for side in ("old", "new")}
ops = s["old"]["applied"]
same = all(summary(side, i)["applied"] == ops for side in ("old", "new") for i in range(1, runs + 1))
# (the CPU ratio below is per run, so it assumes the same ops: `same` says whether they were)
classes = {side: sorted((c["name"], tuple(c["failing_seeds"])) for c in s[side]["classes"]) for side in s}
rate = {side: [s[side]["applied"] / t for t in times[side]] for side in times}  # each side's own ops
ratios = sorted(n / o for n, o in zip(rate["new"], rate["old"]))
for side in ("old", "new"):
    r = rate[side]
    print(f"{side}: {s[side]['applied']} ops per run, {statistics.median(times[side]):.2f} s median [{min(times[side]):.2f}, "
          f"{max(times[side]):.2f}], {statistics.median(r):.0f} ops/s")
print(f"new / old: {statistics.median(ratios):.2f}x median [{ratios[0]:.2f}, {ratios[-1]:.2f}] (run by run)")
cpu = {}
for line in open(f"{out}/cpu.txt").read().split("\n")[-2 * runs - 1:]:
    if line.strip():
        side, i, wall, kv, eng = line.split()
        cpu.setdefault(side, []).append((float(kv), float(eng)))
for side in ("old", "new"):
    tot = [k + e for k, e in cpu[side]]
    print(f"{side} CPU: kvsim {statistics.median(k for k, _ in cpu[side]):.2f} s + engine "
          f"{statistics.median(e for _, e in cpu[side]):.2f} s median, total {statistics.median(tot):.2f} s "
          f"[{min(tot):.2f}, {max(tot):.2f}], {s[side]['applied'] / statistics.median(tot):.0f} ops per CPU second")
cr = sorted((o[0] + o[1]) / (n[0] + n[1]) for n, o in zip(cpu["new"], cpu["old"]))
print(f"old / new CPU: {statistics.median(cr):.2f}x median [{cr[0]:.2f}, {cr[-1]:.2f}] (run by run)")
print("same ops on every run:", same, "; same classes and failing seeds:", classes["old"] == classes["new"])
PY
