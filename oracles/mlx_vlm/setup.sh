#!/usr/bin/env bash
# Creates (idempotently) oracles/mlx_vlm/.venv with the pinned mlx-vlm. mlx-vlm has its own cache module
# (mlx_vlm/models/cache.py), so no mlx-lm; it is installed with --no-deps (its package __init__ needs transformers,
# which kvsim.kit.load_modules does not run) plus numpy, which mlx_vlm.models.cache imports. mlx-vlm 0.7.10 declares
# mlx>=0.32.4; its cache module runs on mlx 0.32.2 (the CPU wheels every other venv here pins). Pillow is there for
# mlx_vlm.models.base (its attention mask and SDPA entry points, which the driver's K/V modes call), which imports PIL.
# When it already holds the pinned versions, nothing touches the network.
set -euo pipefail
cd "$(dirname "$0")"
MLX=0.32.2
MLX_VLM=0.7.10
NUMPY=2.4.6
PILLOW=13.0.0
VENV=.venv

../pinned-venv.sh "$VENV" "mlx==$MLX mlx-cpu==$MLX numpy==$NUMPY pillow==$PILLOW" "mlx-vlm==$MLX_VLM"

PYTHONPATH=../../python "$VENV/bin/python" - <<'PYEOF'
import platform
from importlib.metadata import version
import mlx.core as mx
from kvsim.kit import load_modules
load_modules("mlx_vlm", ["models.cache", "models.base", "speculative.cache_state"])
print(f"python {platform.python_version()}  mlx {version('mlx')} (mlx.core {mx.__version__})  "
      f"mlx-cpu {version('mlx-cpu')}  mlx-vlm {version('mlx-vlm')}  numpy {version('numpy')}  pillow {version('pillow')}  "
      f"default device {mx.default_device()}")
PYEOF
