"""Kernel-only timing of kvsim's exact read against MLX's fused SDPA, on a CUDA build of MLX.

The kernels are read out of the Rust source (`HEADER`, `PARTIAL_SRC`, `COMBINE_SRC` and the launch constants of
`src/cache/exact.rs`), so this measures exactly what the crate launches; `--variant NAME=PATH` adds another copy of
that file (an older revision, say) to the same run. For each decode shape (bf16, H 32/8, D 128) it times a graph of
`--reps` independent reads evaluated at once (GPU throughput, no per-read sync), several runs, median and spread,
and checks on the way that the exact read is batch invariant (row 0 of a masked batch == row 0 alone, bit for bit)
and how far it is from SDPA. Usage (device machine, MLX's CUDA wheel on PYTHONPATH):

    python3 bench/exact_kernels.py --json OUT.json [--variant old=path/to/exact.rs]
"""
import argparse
import json
import math
import re
import statistics
import struct
import time

import mlx.core as mx
import numpy as np


def sources(path):
    text = open(path).read()
    grab = lambda name: re.search(r"const %s: &str = r#\"(.*?)\"#;" % name, text, re.S).group(1)
    const = lambda name: int(re.search(r"const %s: usize = (\d+);" % name, text).group(1))
    return {
        "header": grab("HEADER"),
        "partial": grab("PARTIAL_SRC"),
        "combine": grab("COMBINE_SRC"),
        "chunk": const("CHUNK"),
        "threads": const("THREADS"),
        "qtile": const("QTILE"),
    }


class Exact:
    def __init__(self, name, src):
        self.src = src
        self.partial = mx.fast.cuda_kernel(
            name=f"kvsim_exact_partial_{name}", input_names=["q", "k", "v", "meta"], output_names=["pacc", "pml"],
            source=src["partial"], header=src["header"], ensure_row_contiguous=False)
        self.combine = mx.fast.cuda_kernel(
            name=f"kvsim_exact_combine_{name}", input_names=["pacc", "pml"], output_names=["out"],
            source=src["combine"], header=src["header"], ensure_row_contiguous=False)

    def __call__(self, q, k, v, meta):
        b, hq, l, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        s = self.src
        nch = max(1, math.ceil(n / s["chunk"]))
        rows = b * hq * l
        tiles = math.ceil((hq // hkv) * l / s["qtile"])
        pacc, pml = self.partial(
            inputs=[q, k, v, meta], template=[("T", q.dtype), ("D", d)],
            grid=(nch * s["threads"], hkv * tiles, b), threadgroup=(s["threads"], 1, 1),
            output_shapes=[(rows, nch, d), (rows, nch, 2)], output_dtypes=[mx.float32, mx.float32])
        per = 4
        (out,) = self.combine(
            inputs=[pacc, pml], template=[("T", q.dtype), ("D", d)],
            grid=(math.ceil(rows / per) * 32 * per, 1, 1), threadgroup=(32 * per, 1, 1),
            output_shapes=[(b, hq, l, d)], output_dtypes=[q.dtype])
        return out


def meta_of(lens, n, scale):
    """`visible_ranges` for decode reads (L = 1): row b sees [0, lens[b])."""
    bits = struct.unpack("<i", struct.pack("<f", scale))[0]
    starts, spans = [0], []
    for length in lens:
        if length > 0:
            spans += [0, min(length, n)]
        starts.append(len(spans) // 2)
    return mx.array([bits] + starts + spans, dtype=mx.int32)


def timed(fn, reps, runs):
    mx.eval(fn(0))
    meds = []
    for _ in range(runs):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([fn(i) for i in range(reps)])
        mx.synchronize()
        meds.append((time.perf_counter() - t0) / reps * 1e3)
    meds.sort()
    return {"ms_median": statistics.median(meds), "ms_spread": [meds[0], meds[-1]], "ms_runs": meds}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rs", default="src/cache/exact.rs")
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    variants = {"current": Exact("current", sources(a.rs))}
    for spec in a.variant:
        name, path = spec.split("=", 1)
        variants[name] = Exact(name, sources(path))
    hq, hkv, d = 32, 8, 128
    scale = 1.0 / math.sqrt(d)
    results = []
    for dtype in [mx.bfloat16]:
        for b, w in [(1, 1024), (8, 1024), (64, 1024), (1, 4096), (8, 4096), (64, 4096)]:
            mx.random.seed(b * 7 + w)
            k = mx.random.normal((b, hkv, w, d)).astype(dtype)
            v = mx.random.normal((b, hkv, w, d)).astype(dtype)
            qs = [mx.random.normal((b, hq, 1, d)).astype(dtype) for _ in range(4)]
            mx.eval(k, v, qs)
            meta = meta_of([w] * b, w, scale)
            row = {"B": b, "W": w, "dtype": str(dtype), "kv_bytes": 2 * k.nbytes}
            row["sdpa"] = timed(lambda i: mx.fast.scaled_dot_product_attention(qs[i % 4], k, v, scale=scale), a.reps, a.runs)
            ref = mx.fast.scaled_dot_product_attention(qs[0], k, v, scale=scale).astype(mx.float32)
            for name, ex in variants.items():
                r = timed(lambda i: ex(qs[i % 4], k, v, meta), a.reps, a.runs)
                out = ex(qs[0], k, v, meta).astype(mx.float32)
                r["max_abs_vs_sdpa"] = float(mx.max(mx.abs(out - ref)).item())
                r["gbps"] = row["kv_bytes"] / (r["ms_median"] / 1e3) / 1e9
                r["over_sdpa"] = r["ms_median"] / row["sdpa"]["ms_median"]
                # Batch invariance: row 0 alone (its own length) vs in this batch with other rows masked shorter.
                if b > 1:
                    lens = [w - 37] + [1 + (r_ * 389) % w for r_ in range(1, b)]
                    alone = ex(qs[0][:1], k[:1, :, : w - 37], v[:1, :, : w - 37], meta_of([w - 37], w - 37, scale))
                    batch = ex(qs[0], k, v, meta_of(lens, w, scale))
                    # bf16 -> f32 is exact and one-to-one, so equal f32 bits are equal bf16 bits.
                    a0 = np.array(alone.astype(mx.float32)).view(np.uint32)
                    b0 = np.array(batch[:1].astype(mx.float32)).view(np.uint32)
                    r["row0_batch_equals_alone"] = bool((a0 == b0).all())
                row[name] = r
            # The fused read's own batch vs alone on the same rows (no mask: full rows).
            print(json.dumps({x: (row[x] if not isinstance(row[x], dict) else
                                  {kk: vv for kk, vv in row[x].items() if kk != "ms_runs"}) for x in row}), flush=True)
            results.append(row)
    # Per-call latency with a sync after each read (what one decode step sees), B 1 W 4096: fused, exact with the
    # visibility uploaded per call (as the crate does), exact with it cached.
    b, w = 1, 4096
    k = mx.random.normal((b, hkv, w, d)).astype(mx.bfloat16)
    v = mx.random.normal((b, hkv, w, d)).astype(mx.bfloat16)
    q = mx.random.normal((b, hq, 1, d)).astype(mx.bfloat16)
    mx.eval(k, v, q)
    ex = variants["current"]
    cached = meta_of([w], w, scale)
    lat = {}
    for name, fn in [("sdpa", lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)),
                     ("exact_meta_per_call", lambda: ex(q, k, v, meta_of([w], w, scale))),
                     ("exact_meta_cached", lambda: ex(q, k, v, cached))]:
        ts = []
        for i in range(60):
            t0 = time.perf_counter()
            mx.eval(fn())
            ts.append((time.perf_counter() - t0) * 1e3)
        ts = sorted(ts[10:])
        lat[name] = {"ms_median": statistics.median(ts), "ms_spread": [ts[0], ts[-1]]}
    print(json.dumps({"latency_B1_W4096": lat}), flush=True)
    if a.json:
        json.dump({"rows": results, "latency_B1_W4096": lat, "mlx": mx.__version__}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
