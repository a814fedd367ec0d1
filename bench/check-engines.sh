#!/usr/bin/env bash
# Every engine driver under `kvsim check-engine`, stock and with each planted bug, into bench/results/check-engine-*/.
#
#   bench/check-engines.sh [SEEDS]        # default 500; sets up each engine's venv on first use
#   ONLY='optiq|quant' bench/check-engines.sh 500   # only the runs whose "<dir> <config>" matches the regex
#   KVSIM=target/release/kvsim bench/check-engines.sh  # that binary, no cargo build
#   JOBS=4 bench/check-engines.sh 500     # each run with 4 engines side by side (`check-engine --jobs`; same report)
#
# Per run: <dir>/<config>.log (the command's whole output, its JSON summary last) and <dir>/<config>/ (each class's
# shortest trace and reproducer; the reproducers are not kept in git: the committed ones, re-run by cargo test, are
# under oracles/<engine>/repros/). Exit 0 when every run ended as a check run does (0: no failure, 1: failures);
# 2 when an engine broke or a run could not start.
set -uo pipefail
cd "$(dirname "$0")/.."
SEEDS=${1:-500}
JOBS=${JOBS:-1}
if [ -z "${KVSIM:-}" ]; then  # KVSIM=path: a kvsim binary already built (no cargo build)
  cargo build --release --quiet --bin kvsim || exit 2
  KVSIM=target/release/kvsim
fi
status=0
ONLY=${ONLY:-}
run() { # DIR CONFIG DRIVER... [--only-layer LAYER: kvsim's --only, the last two words]
  if [ -n "$ONLY" ] && ! [[ "$1 $2" =~ $ONLY ]]; then return; fi
  local dir=bench/results/$1 config=$2; shift 2
  local only=()
  if [ "$#" -ge 2 ] && [ "${*: -2:1}" = "--only-layer" ]; then only=(--only "${*: -1}"); set -- "${@:1:$#-2}"; fi
  mkdir -p "$dir"; rm -rf "${dir:?}/$config"
  local start=$SECONDS
  "$KVSIM" check-engine --driver "$*" "${only[@]}" --seeds "$SEEDS" --jobs "$JOBS" --json --out "$dir/$config" >"$dir/$config.log" 2>&1
  local rc=$?
  echo "${dir##*/} $config: exit $rc in $((SECONDS - start)) s"
  grep '^  \[' "$dir/$config.log" | sed 's/; trace.*//'
  [ "$rc" -le 1 ] || status=2
}
for e in mlx_lm vllm_mlx mlx_vlm mlx_optiq; do bash "oracles/$e/setup.sh" >/dev/null || exit 2; done
PY="PYTHONPATH=python"
run check-engine-mlx-lm v2 python3 oracles/mlx_lm/engine.py --only-layer kv,prefix
run check-engine-mlx-lm v1-kv python3 oracles/mlx_lm/engine.py --prefill no --only-layer kv
run check-engine-mlx-lm plant-prefix-short python3 oracles/mlx_lm/engine.py --plant prefix-short --only-layer kv,prefix
run check-engine-mlx-lm quant python3 oracles/mlx_lm/engine.py --kv quant
L="$PY oracles/mlx_lm/.venv/bin/python -m kvsim.drivers.mlx_lm"
run check-engine-mlx-lm recurrent "$L" --only-layer recurrent
run check-engine-mlx-lm recurrent-plant-rec-neighbour "$L" --plant rec-neighbour --only-layer recurrent
run check-engine-mlx-lm recurrent-plant-rec-pad-unmasked "$L" --plant rec-pad-unmasked --only-layer recurrent
run check-engine-mlx-lm chunked "$L" --kv chunked --only-layer kv
run check-engine-mlx-lm chunked-plant-chunk-trim-over "$L" --kv chunked --plant chunk-trim-over --only-layer kv
run check-engine-mlx-lm cachelist "$L" --kv cachelist --only-layer kv
run check-engine-mlx-lm cachelist-plant-cachelist-index "$L" --kv cachelist --plant cachelist-index --only-layer kv
run check-engine-mlx-lm trim-rows "$L" --trim-rows yes --only-layer kv
run check-engine-mlx-lm trim-rows-plant-rollback-uniform "$L" --trim-rows yes --plant rollback-uniform --only-layer kv
O="$PY oracles/mlx_optiq/.venv/bin/python -m kvsim.drivers.mlx_optiq"
run check-engine-mlx-optiq batch "$O"
run check-engine-mlx-optiq rotating "$O" --cache rotating
run check-engine-mlx-optiq plant-quant-row-copy "$O" --plant quant-row-copy
run check-engine-mlx-optiq plant-convert-phase "$O" --cache rotating --plant convert-phase
V="$PY oracles/vllm_mlx/.venv/bin/python -m kvsim.drivers.vllm_mlx"
run check-engine-vllm-mlx stock "$V" --only-layer pool,prefix
run check-engine-vllm-mlx chain "$V" --lookup chain --only-layer pool,prefix
run check-engine-vllm-mlx block "$V" --prefix block --only-layer pool,prefix
run check-engine-vllm-mlx plant "$V" --plant cow-keeps-shared --only-layer pool,prefix
run check-engine-vllm-mlx plant-prefix-short "$V" --lookup chain --plant prefix-short --only-layer pool,prefix
run check-engine-vllm-mlx recurrent "$V" --only-layer recurrent
run check-engine-vllm-mlx recurrent-arrays "$V" --rec arrays --only-layer recurrent
run check-engine-vllm-mlx recurrent-plant-rec-neighbour "$V" --rec-prefill no --plant rec-neighbour --only-layer recurrent
G="$PY oracles/mlx_vlm/.venv/bin/python -m kvsim.drivers.mlx_vlm"
run check-engine-mlx-vlm stock "$G" --only-layer prefix
run check-engine-mlx-vlm plant-prefix-short "$G" --plant prefix-short --only-layer prefix
run check-engine-mlx-vlm recurrent "$G" --only-layer recurrent
run check-engine-mlx-vlm recurrent-plant-rec-neighbour "$G" --rec-prefill no --plant rec-neighbour --only-layer recurrent
run check-engine-mlx-vlm kv-plain "$G" --kv plain --only-layer kv
run check-engine-mlx-vlm kv-quant "$G" --kv quant --only-layer kv
run check-engine-mlx-vlm kv-buffered "$G" --kv buffered --only-layer kv
run check-engine-mlx-vlm kv-convert "$G" --kv convert --only-layer kv
run check-engine-mlx-vlm kv-plant-quant-row-copy "$G" --kv quant --plant quant-row-copy --only-layer kv
run check-engine-mlx-vlm kv-plain-trim-rows "$G" --kv plain --trim-rows yes --only-layer kv
run check-engine-mlx-vlm kv-plain-trim-rows-plant-rollback-uniform "$G" --kv plain --trim-rows yes --plant rollback-uniform --only-layer kv
run check-engine-mlx-vlm kv-quant-trim-rows "$G" --kv quant --trim-rows yes --only-layer kv
exit $status
