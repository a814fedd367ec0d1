#!/usr/bin/env python3
"""kvsim's engine protocol served by mlx-lm 0.32.2's own caches (../PROTOCOL.md, "The engine protocol").

    python3 engine.py          # JSON lines: one request on stdin, one reply on stdout

A launcher: the driver is `kvsim.drivers.mlx_lm` (python/kvsim/drivers/mlx_lm.py), built on the driver kit
(python/kvsim/kit.py). When `mlx` is not importable and the venv `setup.sh` creates sits beside this file, the script
re-runs itself there; it then puts the repository's `python/` on `sys.path` and serves the driver. Equivalent to
`PYTHONPATH=python oracles/mlx_lm/.venv/bin/python -m kvsim.drivers.mlx_lm`.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import mlx.core  # noqa: F401
except ImportError:
    venv = os.path.join(HERE, ".venv", "bin", "python")
    if os.path.exists(venv) and not os.environ.get("KVSIM_ENGINE_IN_VENV"):
        os.environ["KVSIM_ENGINE_IN_VENV"] = "1"
        os.execv(venv, [venv, os.path.abspath(__file__)] + sys.argv[1:])
    print('{"ok": false, "error": "ImportError: mlx is not installed (run oracles/mlx_lm/setup.sh)"}', flush=True)
    sys.exit(3)

sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from kvsim import kit  # noqa: E402
from kvsim.drivers.mlx_lm import MlxLm  # noqa: E402

if __name__ == "__main__":
    kit.serve(MlxLm)
