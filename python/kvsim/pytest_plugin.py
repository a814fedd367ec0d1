"""pytest plugin (loaded through the `pytest11` entry point of the kvsim wheel): the `kvsim_check` fixture.

    def test_cache_matches_solo(kvsim_check):
        kvsim_check(driver="python -m kvsim.drivers.mlx_lm", seeds=200)

`kvsim_check(driver, ...)` runs `kvsim check-engine --driver DRIVER --json` (the installed binary, kvsim._bin) and
fails the test when the engine diverged in a class not listed in `known`: the message names each class, how many
seeds it failed, its shortest shrunk trace (op count and path) and its standalone reproducer's path. An engine that
broke (check-engine's exit 2: a hang, a crash, a malformed reply) fails the test with kvsim's own account of it.

Arguments (all but `driver` optional):
- `driver`: the engine's command line, run through `sh -c`; this interpreter's folder is put first on PATH, so
  `python` is the interpreter pytest runs under (the one with the engine installed).
- `seeds` (default 100), `ops` (ops per seed; kvsim's default 100), `shrinks` (failing seeds shrunk per class).
- `jobs`: engine processes checking seeds side by side (kvsim's `--jobs`, default 1); the report is the one a
  single engine gives.
- `out`: where traces and reproducers go (default: `--kvsim-out DIR`'s `DIR/<test name>`, else the test's
  `tmp_path` / "kvsim").
- `timeout`: seconds the engine may take to answer one request (kvsim's `--timeout-s`, default 60);
  `time_limit`: seconds the whole check may take (default none).
- `known`: classes allowed to fail (an engine's pinned upstream bugs), e.g. `{"rows_vs_solo"}`; an entry matches a
  class by its full name (`adapter_error/row_state`) or the part before `/` (`adapter_error`).

Returns check-engine's JSON summary (`classes`, `seeds`, `failures`, `engine`, `version`, ...) with `"unexpected"`
(the classes that failed the test: none when it returns) and `"known_seen"` added.

Command-line options: `--kvsim-seeds N` overrides every call's `seeds` (a quick local run, a long nightly one);
`--kvsim-jobs N` sets every call's `jobs` (a runner's cores); `--kvsim-bin PATH` runs another kvsim binary (also `$KVSIM_BIN`); `--kvsim-out DIR` keeps every test's traces and
reproducers under `DIR/<test name>` (a CI job uploads DIR).
"""
import json
import os
import shlex
import subprocess

import pytest

from kvsim import _bin


def pytest_addoption(parser):
    group = parser.getgroup("kvsim", "kvsim engine checks (the kvsim_check fixture)")
    group.addoption("--kvsim-seeds", type=int, default=None, help="seeds for every kvsim_check call (overrides the test's)")
    group.addoption("--kvsim-jobs", type=int, default=None,
                    help="engine processes side by side for every kvsim_check call (overrides the test's)")
    group.addoption("--kvsim-bin", default=None, help="the kvsim binary (default: the one installed with this package)")
    group.addoption("--kvsim-out", default=None,
                    help="keep traces and reproducers under DIR/<test name> (default: each test's tmp_path)")


def _is_known(name, known):
    return name in known or name.split("/", 1)[0] in known


def _describe(c):
    seeds = c.get("failing_seeds", [])
    line = (f"[{c['name']}] {len(seeds)} seeds (first {seeds[:5]}); shortest trace {c.get('shortest_ops')} ops: "
            f"{c.get('trace')}; reproducer: {c.get('repro') or 'none'}")
    return line + f"\n    {c.get('message', '')}"


def _tail(text, n=20):
    return "\n".join(text.strip().splitlines()[-n:])


def run_check(driver, *, seeds=100, ops=None, out, timeout=None, time_limit=None, known=(), shrinks=None,
              binary=None, jobs=None):
    """The fixture's body, callable without pytest's machinery: the summary, or an AssertionError-like failure
    through `pytest.fail`."""
    known = set([known] if isinstance(known, str) else known)
    exe = binary or _bin.binary()
    cmd = [exe, "check-engine", "--driver", driver, "--seeds", str(seeds), "--out", str(out), "--json"]
    if ops is not None:
        cmd += ["--ops", str(ops)]
    if timeout is not None:
        cmd += ["--timeout-s", str(int(timeout))]
    if shrinks is not None:
        cmd += ["--shrinks", str(shrinks)]
    if jobs is not None:
        cmd += ["--jobs", str(int(jobs))]
    shown = " ".join(shlex.quote(a) for a in cmd)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=_bin.env(), timeout=time_limit)
    except subprocess.TimeoutExpired:
        p = None  # failed below, outside the handler (no chained traceback in the report)
    if p is None:
        pytest.fail(f"kvsim check-engine ran past time_limit={time_limit}s: {shown}", pytrace=False)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    try:
        summary = json.loads(last)
    except ValueError:
        summary = None
    if p.returncode == 2 or (summary and "engine_failure" in summary):
        what = (summary or {}).get("engine_failure", {})
        pytest.fail(f"kvsim check-engine: the engine broke [{what.get('kind', '?')}]: {what.get('message', '')}\n"
                    f"  command: {shown}\n{_tail(p.stderr)}", pytrace=False)
    if p.returncode not in (0, 1) or summary is None:
        pytest.fail(f"kvsim check-engine exited {p.returncode} without a summary\n  command: {shown}\n"
                    f"{_tail(p.stdout)}\n{_tail(p.stderr)}", pytrace=False)
    classes = summary.get("classes", [])
    unexpected = [c for c in classes if not _is_known(c["name"], known)]
    summary["unexpected"] = [c["name"] for c in unexpected]
    summary["known_seen"] = [c["name"] for c in classes if _is_known(c["name"], known)]
    if unexpected:
        head = (f"kvsim check-engine: {summary.get('engine')} {summary.get('version')} diverged in "
                f"{len(unexpected)} class(es) over {summary.get('seeds')} seeds "
                f"({summary.get('failures')} failing seeds in all)")
        body = "\n".join("  " + _describe(c) for c in unexpected)
        allowed = f"\n  known (allowed): {', '.join(summary['known_seen'])}" if summary["known_seen"] else ""
        pytest.fail(f"{head}\n{body}{allowed}\n  command: {shown}", pytrace=False)
    return summary


@pytest.fixture
def kvsim_check(request, tmp_path):
    """`kvsim_check(driver, seeds=100, ops=None, out=None, timeout=None, time_limit=None, known=(), shrinks=None,
    jobs=None)`:
    kvsim's swarm against the engine `driver` serves; the test fails on a divergence not in `known`."""
    config = request.config
    binary = config.getoption("kvsim_bin") or None
    keep = config.getoption("kvsim_out")

    def check(driver, seeds=100, ops=None, out=None, timeout=None, time_limit=None, known=(), shrinks=None,
              jobs=None):
        seeds = config.getoption("kvsim_seeds") or seeds
        jobs = config.getoption("kvsim_jobs") or jobs
        if out is None:
            out = os.path.join(os.path.abspath(keep), request.node.name) if keep else tmp_path / "kvsim"
        os.makedirs(out, exist_ok=True)
        return run_check(driver, seeds=seeds, ops=ops, out=out, timeout=timeout, time_limit=time_limit,
                         known=known, shrinks=shrinks, binary=binary, jobs=jobs)

    return check
