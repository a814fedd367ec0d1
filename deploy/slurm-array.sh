#!/usr/bin/env bash
# A seed campaign on Slurm: a job array runs the shards, a dependent job merges them.
#
#   deploy/slurm-array.sh [SHARDS] [SEEDS] [FIRST]      # submits both jobs; prints their ids
#
# Each array task runs `kvsim sim --first FIRST --seeds SEEDS --shard $SLURM_ARRAY_TASK_ID/SHARDS --json` into
# $KVSIM_RESULTS/part-<task>.json (default ./kvsim-results), its log into shard-<task>.log and its failing traces
# into failures-<task>/ (replay one with `kvsim replay`). A task ends with kvsim's exit code: 0, or 1 when its shard
# found a failure (Slurm shows it FAILED, ExitCode 1:0), 2 on an error. The merge job (afterany: it runs whatever the
# shards' states) runs `kvsim merge` over every part by name, so a shard that left no part makes it fail (exit 2)
# instead of merging a smaller campaign; its summary goes to merge.log and its JSON line to merged.json, whose
# `result_hash` equals an unsharded run over the same seeds; it exits 1 when any shard found a failure. KVSIM (default: target/release/kvsim) and KVSIM_RESULTS must
# be on a filesystem the compute nodes share. deploy/test-slurm.sh runs this on a one-node cluster it starts.
set -euo pipefail
SHARDS=${1:-16}
SEEDS=${2:-100000}
FIRST=${3:-0}
for n in "$SHARDS" "$SEEDS" "$FIRST"; do
  [[ $n =~ ^[0-9]+$ ]] || { echo "slurm-array.sh: $n is not a number (usage: SHARDS SEEDS FIRST)" >&2; exit 2; }
done
[ "$SHARDS" -ge 1 ] || { echo "slurm-array.sh: SHARDS must be at least 1" >&2; exit 2; }
KVSIM=${KVSIM:-target/release/kvsim}
[ -x "$KVSIM" ] || { echo "slurm-array.sh: no kvsim binary at $KVSIM (cargo build --release, or set KVSIM)" >&2; exit 2; }
KVSIM=$(realpath "$KVSIM")
RESULTS=$(realpath -m "${KVSIM_RESULTS:-kvsim-results}")
mkdir -p "$RESULTS"
# The job scripts are sh; every path is quoted for it (printf %q), whatever characters it holds.
kvsim=$(printf %q "$KVSIM")
results=$(printf %q "$RESULTS")
array=$(sbatch --parsable --job-name=kvsim-shards --array=0-$((SHARDS - 1)) --cpus-per-task=2 --mem=4G \
  --output="$RESULTS/shard-%a.log" --wrap="$kvsim sim --first $FIRST --seeds $SEEDS \
--shard \$SLURM_ARRAY_TASK_ID/$SHARDS --json --out $results/failures-\$SLURM_ARRAY_TASK_ID \
> $results/part-\$SLURM_ARRAY_TASK_ID.json")
array=${array%%;*} # `--parsable` prints `id;cluster` on a multi-cluster setup
parts=$(for ((i = 0; i < SHARDS; i++)); do printf '%q ' "$RESULTS/part-$i.json"; done)
merge=$(sbatch --parsable --job-name=kvsim-merge --dependency=afterany:"$array" --cpus-per-task=1 --mem=1G \
  --output="$RESULTS/merge.log" --wrap="out=\$($kvsim merge $parts--json); rc=\$?; [ -z \"\$out\" ] || printf '%s\n' \"\$out\"
{ [ -z \"\$out\" ] || printf '%s\n' \"\$out\" | tail -n 1; } > $results/merged.json; exit \$rc")
merge=${merge%%;*}
echo "shards: job $array ($SHARDS tasks); merge: job $merge -> $RESULTS/merged.json"
