"""Where the installed `kvsim` binary is, and the environment it runs in.

The wheel installs the binary as a script (`<prefix>/bin/kvsim`); its run path finds the `mlx` wheel's `libmlx.so` in
`<prefix>/lib/python3.X/site-packages/mlx/lib`. `env()` also appends that folder, found by import machinery, to
`LD_LIBRARY_PATH` (after any folder already there, so an `LD_LIBRARY_PATH` pointing at another MLX 0.32.2 build, the
CUDA wheel's `mlx/lib`, still wins): that covers layouts the run path does not (`pip install --target`, a Debian
`dist-packages`), and is what `python -m kvsim` and the pytest fixture run the binary with.
"""
import importlib.util
import os
import shutil
import sys
import sysconfig


def mlx_lib_dir():
    """The `mlx/lib` folder of the importable `mlx` package that holds `libmlx.so`, else None."""
    spec = importlib.util.find_spec("mlx")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(root, "lib")
        if os.path.exists(os.path.join(lib, "libmlx.so")):
            return lib
    return None


def binary():
    """The kvsim binary: `$KVSIM_BIN`, else the one installed with this package (`<target>/bin` of a
    `pip install --target`, the interpreter's scripts folder, the user scheme's), else `kvsim` on PATH."""
    if os.environ.get("KVSIM_BIN"):
        return os.environ["KVSIM_BIN"]
    site = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding the kvsim package
    candidates = [os.path.join(site, "bin", "kvsim")]  # pip install --target: the binary installed with this package
    schemes = [sysconfig.get_default_scheme()] if hasattr(sysconfig, "get_default_scheme") else []
    schemes.append(f"{os.name}_user")
    for scheme in schemes:
        try:
            candidates.append(os.path.join(sysconfig.get_path("scripts", scheme), "kvsim"))
        except KeyError:
            continue
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    found = shutil.which("kvsim")
    if found:
        return found
    raise FileNotFoundError("no kvsim binary: install the kvsim wheel into this environment, or set KVSIM_BIN")


def env(base=None):
    """`base` (default: os.environ) with MLX's lib folder appended to LD_LIBRARY_PATH and this interpreter's folder
    first on PATH (so a driver command `python -m kvsim.drivers.<engine>` runs under this interpreter)."""
    e = dict(os.environ if base is None else base)
    lib = mlx_lib_dir()
    if lib:
        e["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [e.get("LD_LIBRARY_PATH", ""), lib] if p)
    e["PATH"] = os.pathsep.join(p for p in [os.path.dirname(sys.executable), e.get("PATH", "")] if p)
    return e
