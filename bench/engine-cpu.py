#!/usr/bin/env python3
"""Runs a `kvsim check-engine` command line and writes `wall_s kvsim_cpu_s engine_cpu_s` to TIMES: the wall time,
the CPU time (user + system) of kvsim's processes (kvsim and the workers it runs seeds in) and that of its engine
processes (every descendant whose command is `python*`), each sampled from /proc every 20 ms while it runs (kvsim
kills its engine, so the engine's time never reaches a rusage; the last 20 ms of a process may be missed). On a machine shared with other work the wall time measures the load as much as the run;
the CPU times measure the run.

    bench/engine-cpu.py TIMES CMD [ARG ...]     # CMD's own output goes to stdout / stderr as usual
"""
import os
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def children(pid):
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def is_engine(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().startswith("python")
    except OSError:
        return False


def cpu(pid):
    """User + system seconds of the process itself (all its threads), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / HZ
    except (OSError, IndexError, ValueError):
        return None


def main():
    times, cmd = sys.argv[1], sys.argv[2:]
    start = time.monotonic()
    p = subprocess.Popen(cmd)
    own, seen, engine = 0.0, {}, set()
    while p.poll() is None:
        own = max(own, cpu(p.pid) or 0.0)
        todo = children(p.pid)
        while todo:
            c = todo.pop()
            t = cpu(c)
            if t is not None:
                seen[c] = max(seen.get(c, 0.0), t)
                if is_engine(c):
                    engine.add(c)
            todo += children(c)
        time.sleep(0.02)
    wall = time.monotonic() - start
    with open(times, "a") as f:
        kvsim = own + sum(t for c, t in seen.items() if c not in engine)
        f.write(f"{wall:.3f} {kvsim:.3f} {sum(seen[c] for c in engine):.3f}\n")
    sys.exit(p.returncode)


if __name__ == "__main__":
    main()
