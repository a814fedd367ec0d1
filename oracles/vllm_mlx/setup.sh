#!/usr/bin/env bash
# Creates (idempotently) oracles/vllm_mlx/.venv with the pinned vllm-mlx the block-pool driver runs on.
# vllm-mlx 0.6.0 declares mlx-lm>=0.31.3,<0.32.0, so mlx-lm is 0.31.3 here (oracles/mlx_lm uses 0.32.2); both
# packages are installed with --no-deps: the driver imports vllm_mlx.paged_cache (standard library only) and the
# check below imports vllm_mlx.prefix_cache / .memory_cache and mlx_lm.models.cache, which need mlx alone.
# When the venv already holds the pinned versions, nothing touches the network.
set -euo pipefail
cd "$(dirname "$0")"
MLX=0.32.2
MLX_LM=0.31.3
VLLM_MLX=0.6.0
VENV=.venv

../pinned-venv.sh "$VENV" "mlx==$MLX mlx-cpu==$MLX" "mlx-lm==$MLX_LM vllm-mlx==$VLLM_MLX"

PYTHONPATH=../../python "$VENV/bin/python" - <<'PYEOF'
import platform
from importlib.metadata import version
import mlx.core as mx
import vllm_mlx.paged_cache  # imports without stubs (its package __init__ is lazy)
from kvsim.kit import load_modules
load_modules("vllm_mlx", ["prefix_cache", "memory_cache"])
load_modules("mlx_lm", ["models.cache"])
print(f"python {platform.python_version()}  mlx {version('mlx')} (mlx.core {mx.__version__})  "
      f"mlx-cpu {version('mlx-cpu')}  mlx-lm {version('mlx-lm')}  vllm-mlx {version('vllm-mlx')}  "
      f"default device {mx.default_device()}")
PYEOF
