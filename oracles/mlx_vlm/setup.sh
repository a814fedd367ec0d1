#!/usr/bin/env bash
# Creates (idempotently) oracles/mlx_vlm/.venv with the pinned mlx-vlm. mlx-vlm has its own cache module
# (mlx_vlm/models/cache.py), so no mlx-lm; it is installed with --no-deps (its package __init__ needs transformers,
# which kvsim.kit.load_modules does not run) plus numpy, which mlx_vlm.models.cache imports. mlx-vlm 0.7.10 declares
# mlx>=0.32.4; its cache module runs on mlx 0.32.2 (the CPU wheels every other venv here pins). No driver speaks its
# caches yet; this venv is for that work. When it already holds the pinned versions, nothing touches the network.
set -euo pipefail
cd "$(dirname "$0")"
MLX=0.32.2
MLX_VLM=0.7.10
NUMPY=2.4.6
PY=${PYTHON:-python3}
VENV=.venv

have() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$MLX" "$MLX_VLM" "$NUMPY" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
want = {"mlx": sys.argv[1], "mlx-cpu": sys.argv[1], "mlx-vlm": sys.argv[2], "numpy": sys.argv[3]}
sys.exit(0 if all(version(p) == v for p, v in want.items()) else 1)
PYEOF
}

if ! have; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "mlx==$MLX" "mlx-cpu==$MLX" \
    "numpy==$NUMPY"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "mlx-vlm==$MLX_VLM"
  have || { echo "setup.sh: pinned versions not installed" >&2; exit 1; }
fi

PYTHONPATH=../../python "$VENV/bin/python" - <<'PYEOF'
import platform
from importlib.metadata import version
import mlx.core as mx
from kvsim.kit import load_modules
load_modules("mlx_vlm", ["models.cache", "speculative.cache_state"])
print(f"python {platform.python_version()}  mlx {version('mlx')} (mlx.core {mx.__version__})  "
      f"mlx-cpu {version('mlx-cpu')}  mlx-vlm {version('mlx-vlm')}  numpy {version('numpy')}  "
      f"default device {mx.default_device()}")
PYEOF
