#!/usr/bin/env bash
# Creates (idempotently) oracles/mlx_lm/.venv with the pinned mlx / mlx-lm the oracle driver runs on.
# mlx-lm is installed with --no-deps: the driver imports only mlx_lm.models.{base,cache}, which need mlx alone.
# When the venv already holds the pinned versions, nothing touches the network.
set -euo pipefail
cd "$(dirname "$0")"
MLX=0.32.2
MLX_LM=0.32.2
VENV=.venv

../pinned-venv.sh "$VENV" "mlx==$MLX mlx-cpu==$MLX" "mlx-lm==$MLX_LM"

"$VENV/bin/python" - <<'PYEOF'
import platform
from importlib.metadata import version
import mlx.core as mx
print(f"python {platform.python_version()}  mlx {version('mlx')} (mlx.core {mx.__version__})  "
      f"mlx-cpu {version('mlx-cpu')}  mlx-lm {version('mlx-lm')}  default device {mx.default_device()}")
PYEOF
