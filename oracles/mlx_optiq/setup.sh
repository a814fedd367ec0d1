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
PY=${PYTHON:-python3}
VENV=.venv

have() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$MLX" "$MLX_LM" "$OPTIQ" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
want = {"mlx": sys.argv[1], "mlx-cpu": sys.argv[1], "mlx-lm": sys.argv[2], "mlx-optiq": sys.argv[3]}
sys.exit(0 if all(version(p) == v for p, v in want.items()) else 1)
PYEOF
}

if ! have; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "mlx==$MLX" "mlx-cpu==$MLX"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "mlx-lm==$MLX_LM" \
    "mlx-optiq==$OPTIQ"
  have || { echo "setup.sh: pinned versions not installed" >&2; exit 1; }
fi

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
