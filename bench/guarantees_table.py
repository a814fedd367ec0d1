#!/usr/bin/env python3
"""The guarantees table per family x check class x dtype x device, from `kvsim sim --json` summaries.

Usage: python3 bench/guarantees_table.py LABEL=SUMMARY.json ... > table.md

Each SUMMARY is a file whose last line is a `kvsim sim --json` summary (its `layouts.<key>.guarantees` maps
"class/dtype" to {compared, bit_exact, max_ulp}). One column per LABEL and dtype; a cell is
"byte-identical / compared" and, where they differ, the largest distance in ULPs at output scale. Classes that compare
against a model (an f64 or bf16/affine reference of kvsim's own, never a twin) are marked "model": their promise is a
bound, not bytes. Nothing here is judged; the simulator's checks did that during the runs.
"""
import json
import sys

MODEL_CLASSES = {"transition_affine_model", "transition_bf16_model", "vs_f64_dequantized"}


class BadSummary(Exception):
    """A SUMMARY that cannot be read or is not a `kvsim sim --json` summary (reported as one line, exit 2)."""


REQUIRED = ("layouts", "seeds", "device", "ops", "checks", "failures", "result_hash")


def load(path):
    try:
        with open(path) as f:
            lines = [line for line in f.read().splitlines() if line.startswith("{")]
    except OSError as e:
        raise BadSummary(f"{path}: {e.strerror}")
    if not lines:
        raise BadSummary(f"{path}: no JSON line (expected the output of `kvsim sim --json`)")
    try:
        d = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise BadSummary(f"{path}: the last JSON line does not parse: {e}")
    missing = [k for k in REQUIRED if not isinstance(d, dict) or k not in d]
    if missing:
        raise BadSummary(f"{path}: not a `kvsim sim --json` summary (missing {', '.join(missing)})")
    return d


def cell(g):
    if g is None:
        return "-"
    c, e, u = g["compared"], g["bit_exact"], g["max_ulp"]
    text = f"{e:,} / {c:,}"
    return text if e == c else f"{text} (max {u:,} ULP)"


def main(args):
    runs = []
    for a in args:
        label, sep, path = a.partition("=")
        if not sep or not label or not path:
            raise BadSummary(f"{a!r}: expected LABEL=SUMMARY.json")
        runs.append((label, load(path)))
    if not runs:
        raise BadSummary("usage: guarantees_table.py LABEL=SUMMARY.json ...")
    dtypes = ["f32", "bf16"]
    head = ["layout", "check class"] + [f"{label} {dt}" for label, _ in runs for dt in dtypes]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    layouts = sorted({k for _, d in runs for k in d["layouts"]})
    for layout in layouts:
        classes = sorted({key.split("/")[0] for _, d in runs for key in d["layouts"].get(layout, {}).get("guarantees", {})})
        for cls in classes:
            name = f"{cls} (model)" if cls in MODEL_CLASSES else cls
            cells = []
            for _, d in runs:
                g = d["layouts"].get(layout, {}).get("guarantees", {})
                cells += [cell(g.get(f"{cls}/{dt}")) for dt in dtypes]
            print(f"| `{layout}` | {name} | " + " | ".join(cells) + " |")
    print()
    for label, d in runs:
        print(f"- {label}: {d['seeds']} seeds on {d['device']}, {d['ops']:,} ops, {d['checks']:,} checks, "
              f"{d['failures']} failures, result hash `{d['result_hash'][:16]}...`")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BadSummary as e:
        print(f"guarantees_table.py: {e}", file=sys.stderr)
        sys.exit(2)
