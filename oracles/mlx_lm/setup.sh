#!/usr/bin/env bash
# Creates (idempotently) oracles/mlx_lm/.venv with the pinned mlx / mlx-lm the oracle driver runs on.
# mlx-lm is installed with --no-deps: the driver imports only mlx_lm.models.{base,cache}, which need mlx alone.
# When the venv already holds the pinned versions, nothing touches the network.
set -euo pipefail
cd "$(dirname "$0")"
MLX=0.32.2
MLX_LM=0.32.2
PY=${PYTHON:-python3}
VENV=.venv

have() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$MLX" "$MLX_LM" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
want = {"mlx": sys.argv[1], "mlx-cpu": sys.argv[1], "mlx-lm": sys.argv[2]}
sys.exit(0 if all(version(p) == v for p, v in want.items()) else 1)
PYEOF
}

if ! have; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "mlx==$MLX" "mlx-cpu==$MLX"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "mlx-lm==$MLX_LM"
  have || { echo "setup.sh: pinned versions not installed" >&2; exit 1; }
fi

"$VENV/bin/python" - <<'PYEOF'
import platform
from importlib.metadata import version
import mlx.core as mx
print(f"python {platform.python_version()}  mlx {version('mlx')} (mlx.core {mx.__version__})  "
      f"mlx-cpu {version('mlx-cpu')}  mlx-lm {version('mlx-lm')}  default device {mx.default_device()}")
PYEOF
