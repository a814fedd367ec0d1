"""`python -m kvsim ARGS...`: the installed `kvsim` binary with MLX's lib folder on LD_LIBRARY_PATH (kvsim._bin).

The same as running `kvsim ARGS...`, for environments whose layout the binary's run path does not cover.
"""
import os
import sys

from kvsim import _bin


def main():
    exe = _bin.binary()
    os.execve(exe, [exe] + sys.argv[1:], _bin.env())


if __name__ == "__main__":
    main()
