"""Where a batched rotating decode step's time goes, on MLX's own Python API (no kvsim code): the parts of the step
that `kvsim bench --what step` times as one, each timed alone with an evaluation and a sync per step, as the step is.

Shapes as the step bench: bf16, H 32/8, D 128, full rings of W columns, each row writing at its own column. Parts:
- `copy`: a device copy of the K and V rings (`x * 1`, an elementwise kernel that only moves bytes; `astype` to
  float16, MLX's copy kernel; and `concatenate`), the roofline's candidates;
- `write`: the step's write alone, `put_along_axis` of one column per row into K and V with the old buffers
  released before the evaluation (so MLX may donate them and write in place), and the MLX peak memory it needs;
- `write_kept`: the same write with the old buffers still referenced (MLX must copy them): what a failed donation
  costs;
- `read`: MLX's fused SDPA of one query position per row over the rings;
- `read_folded`: the same read with the query heads that share a K/V head folded into query positions (`[B, H_kv,
  H_q / H_kv, D]`, no mask): each K/V head read once for its group;
- `write_then_read`: write, evaluate, read, evaluate (two syncs);
- `write_read_one_eval`: write and read evaluated together (one sync).

Usage (device machine, MLX's CUDA wheel on PYTHONPATH): python3 bench/step_profile.py --json OUT.json
"""
import argparse
import json
import statistics
import time

import mlx.core as mx


def timed(fn, iters, warm=5):
    for i in range(warm):
        fn(i)
    ts = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(warm + i)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def shape_row(b, w, iters, runs):
    hq, hkv, d = 32, 8, 128
    dt = mx.bfloat16
    mx.random.seed(b * 7919 + w)
    state = {
        "k": mx.random.normal((b, hkv, w, d)).astype(dt),
        "v": mx.random.normal((b, hkv, w, d)).astype(dt),
    }
    new = [(mx.random.normal((b, hkv, 1, d)).astype(dt), mx.random.normal((b, hkv, 1, d)).astype(dt),
            mx.random.normal((b, hq, 1, d)).astype(dt)) for _ in range(4)]
    heads = [(r * 37) % w for r in range(b)]
    idx = [mx.array([(h + s) % w for h in heads], dtype=mx.int32).reshape(b, 1, 1, 1) for s in range(8)]
    mx.eval(state["k"], state["v"], *[x for t in new for x in t], *idx)
    kv_bytes = 2 * b * hkv * w * d * 2
    scale = d ** -0.5

    def write(i):
        nk, nv, _ = new[i % 4]
        at = mx.broadcast_to(idx[i % 8], (b, hkv, 1, d))
        k, v = state.pop("k"), state.pop("v")
        state["k"] = mx.put_along_axis(k, at, nk, axis=2)
        state["v"] = mx.put_along_axis(v, at, nv, axis=2)
        del k, v

    def step_write(i):
        write(i)
        mx.eval(state["k"], state["v"])

    kept = []

    def step_write_kept(i):
        kept[:] = [state["k"], state["v"]]
        write(i)
        mx.eval(state["k"], state["v"])
        kept.clear()

    def read(i):
        return mx.fast.scaled_dot_product_attention(new[i % 4][2], state["k"], state["v"], scale=scale)

    def step_read(i):
        mx.eval(read(i))

    g = hq // hkv

    def step_read_folded(i):
        q = new[i % 4][2].reshape(b, hkv, g, d)
        mx.eval(mx.fast.scaled_dot_product_attention(q, state["k"], state["v"], scale=scale).reshape(b, hq, 1, d))

    def step_write_then_read(i):
        write(i)
        mx.eval(state["k"], state["v"])
        mx.eval(read(i))

    def step_one_eval(i):
        write(i)
        out = read(i)
        mx.eval(out, state["k"], state["v"])

    copies = {
        "copy_mul1": lambda i: mx.eval(state["k"] * 1, state["v"] * 1),
        "copy_astype": lambda i: mx.eval(state["k"].astype(mx.float16), state["v"].astype(mx.float16)),
        "copy_concat": lambda i: mx.eval(mx.concatenate([state["k"], state["v"]], axis=0)),
    }
    parts = dict(copies)
    parts.update({"write": step_write, "write_kept": step_write_kept, "read": step_read, "read_folded": step_read_folded,
                  "write_then_read": step_write_then_read, "write_read_one_eval": step_one_eval})
    meds = {name: [] for name in parts}
    for _ in range(runs):
        for name, fn in parts.items():
            meds[name].append(timed(fn, iters))
    row = {"B": b, "W": w, "kv_bytes": kv_bytes}
    for name, ms in meds.items():
        row[name] = {"ms_median": statistics.median(ms), "ms_runs": ms}
    best_copy = min(row[n]["ms_median"] for n in copies)
    row["copy_gbps"] = 2 * kv_bytes / (best_copy / 1e3) / 1e9
    for name in ("read", "read_folded", "write_then_read", "write_read_one_eval"):
        row[name]["of_copy"] = (kv_bytes / (row[name]["ms_median"] / 1e3) / 1e9) / row["copy_gbps"]
    # Peak memory of one donated write and one kept write, over the rings' bytes.
    for name, fn in (("write", step_write), ("write_kept", step_write_kept)):
        mx.eval(state["k"], state["v"])
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        fn(0)
        # MLX resets the peak to 0: a peak below the memory before means the write allocated nothing.
        row[name]["peak_over_rings"] = max(0, mx.get_peak_memory() - before) / kv_bytes
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (a check of the script, not a measurement)")
    ap.add_argument("--shapes", default="1x1024,8x4096,64x1024,64x4096", help="BxW,...")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu if a.cpu else mx.gpu)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    rows = [shape_row(b, w, a.iters, a.runs) for (b, w) in shapes]
    for r in rows:
        line = "  ".join(f"{n} {r[n]['ms_median']:.3f}" for n in r if isinstance(r[n], dict))
        print(f"B {r['B']:>3} W {r['W']:>5}: copy {r['copy_gbps']:.0f} GB/s  {line}")
    out = {"mlx": mx.__version__, "device": str(mx.default_device()), "rows": rows}
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
