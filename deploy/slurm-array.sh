#!/usr/bin/env bash
# A seed campaign on Slurm: a job array runs the shards, a dependent job merges them.
#
#   deploy/slurm-array.sh [SHARDS] [SEEDS] [FIRST]      # submits both jobs; prints their ids
#
# Each array task runs `kvsim sim --first FIRST --seeds SEEDS --shard $SLURM_ARRAY_TASK_ID/SHARDS --json` into
# $KVSIM_RESULTS/part-<task>.json (default ./kvsim-results); the merge job (afterany: it runs even when a shard found a
# failure) runs `kvsim merge` and writes merged.json, whose `result_hash` equals an unsharded run over the same seeds.
# KVSIM (default: target/release/kvsim) must be reachable from the compute nodes (a shared filesystem).
set -euo pipefail
SHARDS=${1:-16}
SEEDS=${2:-100000}
FIRST=${3:-0}
KVSIM=$(realpath "${KVSIM:-target/release/kvsim}")
RESULTS=$(realpath -m "${KVSIM_RESULTS:-kvsim-results}")
mkdir -p "$RESULTS"
array=$(sbatch --parsable --job-name=kvsim-shards --array=0-$((SHARDS - 1)) --cpus-per-task=2 --mem=4G \
  --output="$RESULTS/shard-%a.log" --wrap="'$KVSIM' sim --first $FIRST --seeds $SEEDS \
  --shard \$SLURM_ARRAY_TASK_ID/$SHARDS --json --out '$RESULTS/failures-'\$SLURM_ARRAY_TASK_ID \
  > '$RESULTS/part-'\$SLURM_ARRAY_TASK_ID.json || test \$? = 1")
merge=$(sbatch --parsable --job-name=kvsim-merge --dependency=afterany:"$array" --cpus-per-task=1 --mem=1G \
  --output="$RESULTS/merge.log" --wrap="'$KVSIM' merge '$RESULTS'/part-*.json --json > '$RESULTS/merged.json'")
echo "shards: job $array ($SHARDS tasks); merge: job $merge -> $RESULTS/merged.json"
