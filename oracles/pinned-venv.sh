#!/usr/bin/env bash
# Creates (idempotently) a virtual environment holding exactly the pinned packages an engine driver runs on; each
# oracles/<engine>/setup.sh calls it, then checks that the engine's modules import.
#
#   oracles/pinned-venv.sh VENV "PKG==VERSION ..." "PKG==VERSION ..."
#
# The first list is installed with its dependencies, the second with --no-deps (an engine's package whose own
# dependencies, e.g. transformers, its cache modules do not need). When VENV already holds every pinned version,
# nothing touches the network. PYTHON picks the interpreter that creates it (default python3).
set -euo pipefail
VENV=${1:?venv folder}; WITH=${2:?pinned packages}; NODEPS=${3:-}
PY=${PYTHON:-python3}

have() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - $WITH $NODEPS <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
want = dict(a.split("==") for a in sys.argv[1:])
sys.exit(0 if all(version(p) == v for p, v in want.items()) else 1)
PYEOF
}

if ! have; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $WITH
  # shellcheck disable=SC2086
  [ -z "$NODEPS" ] || "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps $NODEPS
  have || { echo "pinned-venv.sh: pinned versions not installed in $VENV" >&2; exit 1; }
fi
