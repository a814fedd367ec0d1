#!/usr/bin/env bash
# Builds the kvsim wheel (the release `kvsim` binary + the driver kit python/kvsim) into target/wheels/ with maturin
# (pyproject.toml, docs/python.md). maturin comes from PATH, else from a throwaway venv under target/wheel-tools.
#
#   python/build-wheel.sh            # -> target/wheels/kvsim-<version>-py3-none-manylinux_2_35_x86_64.whl
#
# The binary's run path is set to the `mlx/lib` folder of site-packages relative to the installed binary
# (<prefix>/bin/kvsim -> <prefix>/lib/python3.X/site-packages/mlx/lib, one entry per Python that MLX 0.32.2 has
# wheels for), never to this machine's MLX: the check at the end fails the build if an absolute path got in.
set -euo pipefail
cd "$(dirname "$0")/.."
MATURIN=${MATURIN:-maturin==1.16.0}
PY=${PYTHON:-python3}

if command -v maturin > /dev/null && [ -z "${KVSIM_FRESH_MATURIN:-}" ]; then
  mat=maturin
else
  tools=target/wheel-tools
  if [ ! -x "$tools/bin/maturin" ]; then
    "$PY" -m venv "$tools"
    "$tools/bin/python" -m pip install --quiet --disable-pip-version-check "$MATURIN"
  fi
  mat=$tools/bin/maturin
fi
echo "build-wheel: $($mat --version)"

rpath=""
for minor in 10 11 12 13 14 15; do
  rpath+="${rpath:+:}\$ORIGIN/../lib/python3.$minor/site-packages/mlx/lib"
done
export KVSIM_RPATH=$rpath

rm -f target/wheels/kvsim-*.whl
"$mat" build --release --out target/wheels "$@"
wheel=$(ls target/wheels/kvsim-*.whl)

# The shipped binary must find libmlx.so only through $ORIGIN (no path of this machine), and the kit must be in.
"$PY" - "$wheel" <<'PYEOF'
import os, subprocess, sys, tempfile, zipfile
wheel = sys.argv[1]
with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
    names = z.namelist()
    binary = next(n for n in names if n.endswith(".data/scripts/kvsim"))
    for need in ("kvsim/kit.py", "kvsim/pytest_plugin.py", "kvsim/drivers/mlx_lm.py", "kvsim/drivers/vllm_mlx.py"):
        assert need in names, f"{wheel} lacks {need}"
    path = z.extract(binary, tmp)
    dyn = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    run = [l for l in dyn.splitlines() if "RUNPATH" in l or "RPATH" in l]
    entries = [e for l in run for e in l.split("[", 1)[1].rstrip("]").split(":")]
    bad = [e for e in entries if not e.startswith("$ORIGIN/")]
    assert entries and not bad, f"the binary's run path must be $ORIGIN-relative only, found {entries}"
    size = os.path.getsize(wheel)
    print(f"build-wheel: {wheel} ({size / 2**20:.1f} MiB; binary {z.getinfo(binary).file_size / 2**20:.1f} MiB, "
          f"{len(names)} files); run path {entries[0]} (+{len(entries) - 1})")
PYEOF
