#!/usr/bin/env bash
# deploy/slurm-array.sh end to end on a real Slurm cluster started here, and deploy/k8s-*.yaml validated offline.
#
#   deploy/test-slurm.sh [OUT]        # root on Debian; OUT defaults to target/slurm-test; exit 0 when every check passed
#
# 1. Installs Debian's slurm-wlm and munge when missing, writes a one-node configuration for this host (2 CPUs,
#    select/cons_tres, no accounting daemon: job states from `scontrol show job` and the jobcomp/filetxt log) in a
#    temporary folder, starts munged, slurmctld and slurmd there (own socket, ports, state and spool folders; every
#    daemon is stopped by its process id on exit) and waits until `sinfo` shows the node idle.
# 2. Runs `deploy/slurm-array.sh $SHARDS $SEEDS $FIRST` (default 4 200 7000) as a user would, with KVSIM pointing at a
#    release binary (default target/release/kvsim), waits for both jobs and checks that merged.json equals
#    `kvsim sim --first $FIRST --seeds $SEEDS --json` run directly, field for field but `seconds` (result_hash too).
# 3. Runs it again with a failure planted in shard 1 (KVSIM is a wrapper that arms catalog mutant $MUTANT through
#    KVSIM_MUTANT for array task 1 only) and checks that the shard ends FAILED with exit code 1, that the merge job
#    still runs (afterany) and reports the failure (exit 1), and that the failing trace lies under the results folder
#    and replays (`kvsim replay`: the trace records the mutant and the failure; it exits 1 at the same op).
#    Then once more with the last shard cancelled while pending: the merge still runs and fails (exit 2) naming the
#    missing part, instead of merging a smaller campaign.
# 4. Validates deploy/k8s-*.yaml against the Kubernetes schemas offline (`kubernetes-validate` 1.37.0 from PyPI in a
#    venv, strict: unknown fields are errors; $K8S_VERSIONS, default 1.25.0 and 1.37.0), after checking that the
#    validator refuses a broken copy; then runs the merge job's shell command under /bin/sh on the three campaigns'
#    parts (exit 0, 1, 2 as kvsim merge said; merged.json as the Slurm merge's).
# Everything it prints is also written to OUT/test-slurm.log.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${1:-$ROOT/target/slurm-test}")
KVSIM=$(realpath "${KVSIM:-$ROOT/target/release/kvsim}")
SHARDS=${SHARDS:-4}
SEEDS=${SEEDS:-200}
FIRST=${FIRST:-7000}
MUTANT=${MUTANT:-temporal-head}
PORT=${SLURM_TEST_PORT:-16817} # slurmctld on PORT, slurmd on PORT+1
K8S_VERSIONS=${K8S_VERSIONS:-1.25.0 1.37.0} # the oldest and the newest schema kubernetes-validate 1.37.0 ships
rm -rf "$OUT"
mkdir -p "$OUT"
exec > >(tee "$OUT/test-slurm.log") 2>&1
say() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() {
  say "FAIL: $*"
  exit 1
}
test -x "$KVSIM" || die "no kvsim binary at $KVSIM (cargo build --release, or set KVSIM)"

# --- 1. a one-node cluster ---------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null ||
  ! command -v munged >/dev/null; then
  say "installing slurm-wlm and munge (Debian)"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

T=$(mktemp -d /tmp/kvsim-slurm.XXXXXX)
PIDS=()
stop_daemons() {
  local pid
  for pid in "${PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  # The daemons' logs are worth keeping; the rest of the state folder is not.
  cp "$T"/*.log "$OUT/" 2>/dev/null || true
  rm -rf "$T"
}
trap stop_daemons EXIT

mkdir -p "$T/state" "$T/spool" "$T/munge"
chmod 700 "$T/munge"
dd if=/dev/urandom of="$T/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$T/munge/munge.key"
munged --foreground --force --key-file="$T/munge/munge.key" --socket="$T/munge/munge.sock" \
  --pid-file="$T/munge/munged.pid" --log-file="$T/munged.log" --seed-file="$T/munge/munged.seed" >"$T/munged.out" 2>&1 &
PIDS+=($!)

NODE=$(hostname -s)
MEM=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2)) # MiB: half of this host's memory
cat >"$T/slurm.conf" <<EOF
ClusterName=kvsimtest
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$T/munge/munge.sock
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/slurmctld.log
SlurmdLogFile=$T/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$T/jobcomp.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
MinJobAge=3600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=2 RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$T/slurm.conf
cp "$T/slurm.conf" "$OUT/slurm.conf"
slurmctld -D -i >"$T/slurmctld.out" 2>&1 &
PIDS+=($!)
slurmd -D >"$T/slurmd.out" 2>&1 &
PIDS+=($!)

for _ in $(seq 60); do
  state=$(sinfo -h -N -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 1
done
[ "${state:-}" = idle ] || die "node never became idle (sinfo: ${state:-no answer}); see $OUT/slurmctld.log"
say "cluster up: $(sinfo --version), munge $(munged --version 2>&1 | awk '{print $1; exit}'); sinfo:"
sinfo
say "sacct (no accounting daemon here, so states come from scontrol and the jobcomp/filetxt log):"
sacct 2>&1 | head -n 2 || true

# --- helpers -----------------------------------------------------------------------------------------------------
# Waits until no job of the given ids is pending or running (completed jobs stay listed for MinJobAge seconds).
wait_jobs() {
  for _ in $(seq 1800); do
    [ -z "$(squeue -h -j "$1" -t PENDING,RUNNING,CONFIGURING,COMPLETING 2>/dev/null)" ] && return 0
    sleep 1
  done
  die "jobs $1 still running after 30 minutes"
}
# Every job of the given ids (array tasks one by one), as the controller holds it after the end: name, state, exit.
job_states() {
  local id
  for id in $(squeue -h -j "$1" -t all -o %i | sort -V); do
    scontrol -o show job "$id" | tr ' ' '\n' | grep -E '^(JobId|ArrayJobId|ArrayTaskId|JobName|JobState|ExitCode)=' |
      paste -sd' '
  done
}
# JobState=... ExitCode=... of one job (or array task, as JOB_TASK), from the controller.
job_state() {
  scontrol show job "$1" | tr ' ' '\n' | grep -E '^(JobState|ExitCode)=' | paste -sd' '
}
# Submits a campaign the way a user would (from DIR, results into DIR); sets ARRAY and MERGE.
submit() {
  local dir=$1 kvsim=$2 line
  mkdir -p "$dir"
  line=$(cd "$dir" && KVSIM=$kvsim KVSIM_RESULTS=$dir "$ROOT/deploy/slurm-array.sh" "$SHARDS" "$SEEDS" "$FIRST")
  echo "$line" | tee "$dir/submit.txt"
  ARRAY=$(sed -E 's/^shards: job ([0-9]+) .*/\1/' <<<"$line")
  MERGE=$(sed -E 's/.*merge: job ([0-9]+) .*/\1/' <<<"$line")
}
# submit, then wait for both jobs.
campaign() {
  submit "$@"
  wait_jobs "$ARRAY,$MERGE"
}

# --- 2. a clean campaign: merged.json equals the direct run ------------------------------------------------------
say "campaign: deploy/slurm-array.sh $SHARDS $SEEDS $FIRST (KVSIM=$KVSIM)"
campaign "$OUT/clean" "$KVSIM"
say "squeue -t all after both jobs ended (state, exit code):"
job_states "$ARRAY,$MERGE" | tee "$OUT/clean/states.txt"
for t in $(seq 0 $((SHARDS - 1))); do
  [ "$(job_state "${ARRAY}_$t")" = "JobState=COMPLETED ExitCode=0:0" ] || die "shard $t: $(job_state "${ARRAY}_$t")"
done
[ "$(job_state "$MERGE")" = "JobState=COMPLETED ExitCode=0:0" ] || die "merge: $(job_state "$MERGE")"
say "merge.log (first lines):"
head -n 3 "$OUT/clean/merge.log"
say "direct run: kvsim sim --first $FIRST --seeds $SEEDS --json"
"$KVSIM" sim --first "$FIRST" --seeds "$SEEDS" --json --out "$OUT/direct-failures" >"$OUT/direct.json"
python3 - "$OUT/clean/merged.json" "$OUT/direct.json" <<'EOF'
import json, sys
def last(p):
    return json.loads([l for l in open(p) if l.startswith("{")][-1])
merged, direct = last(sys.argv[1]), last(sys.argv[2])
for k in ("seeds", "ops", "checks", "failures", "result_hash"):
    print(f"  {k:12} merged {merged[k]!s:66} direct {direct[k]}")
for v in (merged, direct):
    v.pop("seconds")
if merged != direct:
    diff = sorted(k for k in set(merged) | set(direct) if merged.get(k) != direct.get(k))
    sys.exit(f"merged.json differs from the direct run in {diff}")
print("  merged.json equals the direct run in every field but seconds")
EOF

# --- 3. a campaign with a failure planted in shard 1 -------------------------------------------------------------
say "campaign with mutant $MUTANT armed in shard 1 only"
mkdir -p "$OUT/planted"
# A name with a space, parentheses and a quote: slurm-array.sh must quote KVSIM inside its job scripts.
wrapper="$OUT/planted/kvsim (shard 1's mutant)"
cat >"$wrapper" <<EOF
#!/bin/sh
# kvsim, with catalog mutant $MUTANT armed in array task 1 only.
if [ "\${SLURM_ARRAY_TASK_ID:-}" = 1 ]; then export KVSIM_MUTANT=$MUTANT; fi
exec $(printf %q "$KVSIM") "\$@"
EOF
chmod +x "$wrapper"
campaign "$OUT/planted" "$wrapper"
say "squeue -t all after both jobs ended (state, exit code):"
job_states "$ARRAY,$MERGE" | tee "$OUT/planted/states.txt"
for t in $(seq 0 $((SHARDS - 1))); do
  want="JobState=COMPLETED ExitCode=0:0"
  [ "$t" = 1 ] && want="JobState=FAILED ExitCode=1:0"
  [ "$(job_state "${ARRAY}_$t")" = "$want" ] || die "shard $t: $(job_state "${ARRAY}_$t"), expected $want"
done
[ "$(job_state "$MERGE")" = "JobState=FAILED ExitCode=1:0" ] || die "merge: $(job_state "$MERGE"), expected exit 1"
say "merge.log (first lines):"
head -n 6 "$OUT/planted/merge.log"
say "shard-1.log (first lines):"
head -n 3 "$OUT/planted/shard-1.log"
python3 - "$OUT/planted/merged.json" "$OUT/planted/first-failure.txt" <<'EOF'
import json, sys
m = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
print(f"  merged.json: {m['seeds']} seeds, {m['failures']} failures, result_hash {m['result_hash']}")
for f in m["failed_seeds"][:3]:
    print(f"  failed: seed {f['seed']} op {f['op_index']} [{f['check']}] trace {f['trace']}")
assert m["failures"] > 0, "merged.json reports no failure"
f = m["failed_seeds"][0]
open(sys.argv[2], "w").write(f"{f['op_index']}\t{f['trace']}\n")
EOF
traces=$(find "$OUT/planted/failures-1" -name 'seed-*.json' | wc -l)
[ "$traces" -gt 0 ] || die "no failing trace under $OUT/planted/failures-1"
[ -z "$(find "$OUT/planted" -path '*/failures-[!1]*' -name 'seed-*.json')" ] || die "a clean shard wrote a failing trace"
IFS=$'\t' read -r op trace <"$OUT/planted/first-failure.txt"
[[ $trace == "$OUT/planted/failures-1/"* && -f $trace ]] || die "the failing trace $trace is not under the results folder"
say "$traces failing traces under $OUT/planted/failures-1; kvsim replay $trace:"
# The trace records the mutant and the failure; replay re-arms the one and reproduces the other (exit 1: the trace
# expects a pass, the regression it would be).
set +e
"$KVSIM" replay "$trace" | tee "$OUT/planted/replay.txt"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" != 1 ] || ! grep -q "^replay: first divergence at op $op " "$OUT/planted/replay.txt"; then
  die "kvsim replay (exit $rc) does not reproduce the failure at op $op"
fi

# --- 3b. a shard cancelled before it ran: the merge still runs, and refuses to merge a smaller campaign ---------
last=$((SHARDS - 1))
say "campaign with shard $last cancelled while pending (scancel)"
submit "$OUT/cancelled" "$KVSIM"
scancel "${ARRAY}_$last"
wait_jobs "$ARRAY,$MERGE"
say "squeue -t all after both jobs ended (state, exit code):"
job_states "$ARRAY,$MERGE" | tee "$OUT/cancelled/states.txt"
# A pending array task cancelled before it was split off the array leaves no record of its own (no scontrol state,
# no jobcomp line): only its absence, and the controller's log of the kill request, say it never ran.
[ "$(job_states "$ARRAY" | wc -l)" = "$last" ] || die "expected $last shard records, the cancelled one gone"
grep "_slurm_rpc_kill_job: REQUEST_KILL_JOB JobId=${ARRAY}_$last " "$T/slurmctld.log" || die "no kill request logged"
[ "$(job_state "$MERGE")" = "JobState=FAILED ExitCode=2:0" ] || die "merge: $(job_state "$MERGE"), expected exit 2"
say "merge.log:"
cat "$OUT/cancelled/merge.log"
grep -q "part-$last.json" "$OUT/cancelled/merge.log" || die "the merge does not name the missing part"

# --- 4. Kubernetes manifests, offline -----------------------------------------------------------------------------
VENV=${K8S_VENV:-$ROOT/target/k8s-validate-venv}
if ! "$VENV/bin/kubernetes-validate" --version >/dev/null 2>&1; then
  say "installing kubernetes-validate (PyPI) into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q kubernetes-validate==1.37.0
fi
sed 's/completionMode: Indexed/completionMode: Indexed\n  completionz: 16/' "$ROOT/deploy/k8s-indexed-job.yaml" \
  >"$OUT/broken-k8s.yaml"
: >"$OUT/k8s-validate.txt"
for v in $K8S_VERSIONS; do
  if "$VENV/bin/kubernetes-validate" --quiet --strict -k "$v" "$OUT/broken-k8s.yaml" >/dev/null 2>&1; then
    die "the validator accepted a manifest with an unknown field (Kubernetes $v)"
  fi
  say "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version) --strict -k $v deploy/k8s-*.yaml" |
    tee -a "$OUT/k8s-validate.txt"
  (cd "$ROOT" && "$VENV/bin/kubernetes-validate" --strict -k "$v" deploy/k8s-*.yaml) | tee -a "$OUT/k8s-validate.txt"
done
rm -f "$OUT/broken-k8s.yaml"
# The merge job's shell command itself, run by this host's /bin/sh (dash, as in the image) on the parts of the three
# campaigns above, with /results a copy: exit 0, 1 (a shard failed) and 2 (a part missing), as `kvsim merge` said.
merge_cmd=$("$VENV/bin/python" -c 'import sys, yaml
job = yaml.safe_load(open(sys.argv[1]))
print(job["spec"]["template"]["spec"]["containers"][0]["args"][0])' "$ROOT/deploy/k8s-merge-job.yaml")
for run in clean:0 planted:1 cancelled:2; do
  r="$OUT/k8s-merge-${run%:*}"
  mkdir -p "$r"
  cp "$OUT/${run%:*}"/part-*.json "$r/"
  set +e
  PATH="$(dirname "$KVSIM"):$PATH" SHARDS=$SHARDS sh -c "${merge_cmd//\/results/$r}" >/dev/null 2>&1
  rc=$?
  set -e
  say "k8s merge job's command on the ${run%:*} campaign's parts: exit $rc, merged.json $(wc -c <"$r/merged.json") bytes" |
    tee -a "$OUT/k8s-validate.txt"
  [ "$rc" = "${run#*:}" ] || die "the k8s merge job's command exited $rc, kvsim merge ${run#*:}"
done
# The same parts merge into the same bytes (`seconds` too: the slowest part's).
cmp "$OUT/clean/merged.json" "$OUT/k8s-merge-clean/merged.json" || die "k8s and Slurm merges differ"
say "PASS: Slurm campaign merged = direct run, planted failure reported and replayed, cancelled shard refused, k8s manifests valid"
