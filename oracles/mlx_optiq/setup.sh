#!/usr/bin/env bash
# Creates (idempotently) oracles/mlx_optiq/.venv with the pinned mlx-optiq and the mlx-lm its caches subclass.
# Both are installed with --no-deps: optiq's cache modules (optiq.runtime.kv.*) need mlx and mlx_lm.models.cache,
# loaded without running either package's __init__ (kvsim.kit.load_modules). No driver speaks its quantized
# caches yet; this venv is for that work. When it already holds the pinned versions, nothing touches the network.
set -euo pipefail
cd "$(dirname "$0")"
MLX=0.32.2
MLX_LM=0.32.2
OPTIQ=0.7.7
VENV=.venv

../pinned-venv.sh "$VENV" "mlx==$MLX mlx-cpu==$MLX" "mlx-lm==$MLX_LM mlx-optiq==$OPTIQ"

PYTHONPATH=../../python "$VENV/bin/python" - <<'PYEOF'
import platform
from importlib.metadata import version
import mlx.core as mx
from kvsim.kit import load_modules
load_modules("mlx_lm", ["models.base", "models.cache"])
load_modules("optiq", ["runtime.kv.rotating", "runtime.kv.batch", "runtime.kv.batch_rotating_merge",
                       "runtime.kv.latent", "runtime.spec.kv_view"])
print(f"python {platform.python_version()}  mlx {version('mlx')} (mlx.core {mx.__version__})  "
      f"mlx-cpu {version('mlx-cpu')}  mlx-lm {version('mlx-lm')}  mlx-optiq {version('mlx-optiq')}  "
      f"default device {mx.default_device()}")
PYEOF
