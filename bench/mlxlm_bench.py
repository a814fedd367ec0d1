#!/usr/bin/env python3
# kvsim's anchor benchmark: mlx-lm's own rotating caches, measured on the same schedules as `kvsim bench`.
#
# What it measures (each sub-command prints one JSON line, which `kvsim bench` (src/bench.rs) reads):
#   sim   throughput (row-steps/s) of a Python harness over mlx-lm's BatchRotatingKVCache on a continuous-batching
#         schedule (solo prefill in RotatingKVCache, merge, decode, extract, filter), every row shadowed by a solo
#         RotatingKVCache; counts how many decode outputs and stored K/V are byte-identical batch vs solo
#         (docs/upstream-facts.md, "Batch vs solo in mlx-lm").
#   step  median latency of one batched decode step: BatchRotatingKVCache.update_and_fetch + mask + fused SDPA.
#
# Needs only `mlx` (with a runtime wheel: `mlx-cpu==0.32.2`, or `mlx-cuda-13==0.32.2` on an NVIDIA GPU) and
# `mlx-lm==0.32.2` installed with `--no-deps`: it imports mlx_lm.models.cache and mlx_lm.models.base without running
# mlx_lm/__init__.py (so no transformers). `kvsim bench` runs it with the oracle's Python (oracles/mlx_lm/.venv) by
# default. Examples:
#   python bench/mlxlm_bench.py sim --heads-q 4 --heads-kv 2 --head-dim 16 --window 8 --requests 64 --max-batch 8 \
#       --steps 2000 --dtype bf16 --device cpu
#   python bench/mlxlm_bench.py step -B 64 --heads-kv 8 --heads-q 32 --head-dim 128 --window 4096 --dtype bf16 \
#       --device gpu
"""Anchor benchmark for mlx-lm rotating KV caches (RotatingKVCache / BatchRotatingKVCache).

Two sub-commands, each printing one JSON line:

  sim   continuous-batching schedule over BatchRotatingKVCache with a per-row
        SOLO RotatingKVCache shadow; compares batch-vs-solo attention outputs
        and stored K/V bitwise at every decode step.
  step  per-decode-step latency of BatchRotatingKVCache.update_and_fetch + SDPA.

Only mlx_lm.models.cache and mlx_lm.models.base are imported; the mlx_lm
package __init__ (which pulls transformers / huggingface_hub) is bypassed.
Random data comes from mx.random with explicit keys on the CPU stream and the
schedule from Python's random.Random, so the inputs are identical on every
machine/device for a given seed (numpy is not needed).
"""
import argparse
import importlib.util
import json
import os
import platform
import random
import sys
import time
import types

import mlx.core as mx


# --------------------------------------------------------------------------
# loading mlx_lm.models.{base,cache} without running mlx_lm/__init__.py
# --------------------------------------------------------------------------
def load_mlxlm():
    spec = importlib.util.find_spec("mlx_lm")  # does not execute the package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("mlx_lm not found on sys.path")
    pkg_dir = list(spec.submodule_search_locations)[0]
    if "mlx_lm" not in sys.modules:
        pkg = types.ModuleType("mlx_lm")
        pkg.__path__ = [pkg_dir]
        pkg.__file__ = os.path.join(pkg_dir, "__init__.py")
        sys.modules["mlx_lm"] = pkg
        models = types.ModuleType("mlx_lm.models")
        models.__path__ = [os.path.join(pkg_dir, "models")]
        sys.modules["mlx_lm.models"] = models
        pkg.models = models
    import mlx_lm.models.base  # noqa: F401
    import mlx_lm.models.cache as cache_mod

    version = "?"
    try:
        import mlx_lm._version as v

        version = v.__version__
    except Exception:
        pass
    return cache_mod, version, pkg_dir


CACHE, MLXLM_VERSION, MLXLM_DIR = load_mlxlm()
RotatingKVCache = CACHE.RotatingKVCache
BatchRotatingKVCache = CACHE.BatchRotatingKVCache

DTYPES = {"bf16": mx.bfloat16, "f32": mx.float32, "f16": mx.float16}
BITS = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16, mx.float32: mx.uint32}


def setup_device(name):
    dev = mx.gpu if name == "gpu" else mx.cpu
    mx.set_default_device(dev)
    return str(mx.default_device())


def env_info(args):
    info = {
        "mlx": mx.__version__,
        "mlx_lm": MLXLM_VERSION,
        "python": platform.python_version(),
        "host": platform.node(),
        "device_str": str(mx.default_device()),
    }
    try:
        if args.device == "gpu" and hasattr(mx, "cuda") and mx.cuda.is_available():
            info["gpu"] = mx.device_info().get("device_name", "cuda")
    except Exception:
        pass
    return info


def bits(a):
    return a.view(BITS[a.dtype])


def normal(shape, key, dt):
    # Generated on the CPU stream so data is identical across devices.
    return mx.random.normal(shape, key=key, stream=mx.cpu).astype(dt, stream=mx.cpu)


# --------------------------------------------------------------------------
# sim workload
# --------------------------------------------------------------------------
class Req:
    __slots__ = ("rid", "P", "G", "q", "k", "v", "pos", "gen", "solo")

    def __init__(self, rid, P, G, seed, Hq, Hkv, D, dt):
        self.rid, self.P, self.G = rid, P, G
        T = P + G
        kq, kk, kv = mx.random.split(mx.random.key(seed * 1_000_003 + rid), 3)
        self.q = normal((1, Hq, T, D), kq, dt)
        self.k = normal((1, Hkv, T, D), kk, dt)
        self.v = normal((1, Hkv, T, D), kv, dt)
        mx.eval(self.q, self.k, self.v)
        self.pos = 0
        self.gen = 0
        self.solo = None


def run_sim(args):
    dev = setup_device(args.device)
    dt = DTYPES[args.dtype]
    W, Hq, Hkv, D = args.window, args.heads_q, args.heads_kv, args.head_dim
    scale = D ** -0.5
    rng = random.Random(args.seed)
    mx.random.seed(args.seed)
    prompt_max = args.prompt_max or (2 * W + 3)
    gen_max = args.gen_max or max(2, (2 * args.steps * args.max_batch) // args.requests)
    chunks = None
    if args.schedule:
        # kvsim's equal-work schedule (src/bench.rs, `Schedule`): the same requests, lengths and prefill chunks
        # kvsim runs, replacing this script's own draws.
        with open(args.schedule) as f:
            sched = json.load(f)
        if sched["window"] != W:
            raise SystemExit(f"schedule window {sched['window']} != --window {W}")
        args.max_batch, args.steps = sched["max_batch"], sched["steps"]
        specs = [(p, g) for p, g, _ in sched["requests"]]
        chunks = [list(c) for _, _, c in sched["requests"]]
        args.requests = len(specs)
    else:
        specs = [(rng.randint(1, prompt_max), rng.randint(1, gen_max)) for _ in range(args.requests)]

    ops = dict(
        solo_update_prefill=0, solo_update_decode=0, solo_make_mask=0, solo_sdpa=0,
        batch_update=0, batch_make_mask=0, batch_sdpa=0,
        merge=0, extend=0, extract=0, filter=0,
    )
    verify_extracts = 0
    t = dict(prefill=0.0, inputs=0.0, batch=0.0, solo=0.0, verify=0.0, finish=0.0)
    pending = list(range(args.requests))
    rows = []  # Req objects in batch-row order
    batch = None
    n_cmp = n_out_eq = n_state_eq = 0
    n_final = n_final_eq = 0
    max_abs_out = 0.0
    first_mismatch = None
    admitted = finished = steps_run = 0
    merged_rows = 0
    diag = dict(mismatch=0, batch_row_alone_eq_batch=0, solo_truemask_eq_solo=0,
                solo_temporal_eq_solo=0, solo_temporal_eq_batch=0, batch_rotated=0, solo_rotated=0)

    def solo_attend(c, q, k, v, phase):
        L = q.shape[2]
        mask = c.make_mask(L)
        ops["solo_make_mask"] += 1
        K, V = c.update_and_fetch(k, v)
        ops["solo_update_" + phase] += 1
        out = mx.fast.scaled_dot_product_attention(q, K, V, scale=scale, mask=mask)
        ops["solo_sdpa"] += 1
        return out

    wall0 = time.perf_counter()
    for step in range(args.steps):
        if not rows and not pending:
            break
        # ---- admission: solo chunked prefill, then merge / extend ----
        free = args.max_batch - len(rows)
        if free > 0 and pending:
            t0 = time.perf_counter()
            new = []
            for _ in range(min(free, args.admit_per_step or free, len(pending))):
                rid = pending.pop(0)
                P, G = specs[rid]
                r = Req(rid, P, G, args.seed, Hq, Hkv, D, dt)
                c = RotatingKVCache(max_size=W)
                while r.pos < P:
                    if chunks is not None:
                        L = chunks[rid].pop(0)
                    else:
                        L = args.chunk if args.chunk > 0 else rng.randint(1, W)
                    L = min(L, P - r.pos)
                    sl = slice(r.pos, r.pos + L)
                    out = solo_attend(c, r.q[:, :, sl], r.k[:, :, sl], r.v[:, :, sl], "prefill")
                    mx.eval(out, c.keys, c.values)
                    r.pos += L
                r.solo = c
                new.append(r)
                admitted += 1
            nb = BatchRotatingKVCache.merge([r.solo for r in new])
            ops["merge"] += 1
            merged_rows += len(new)
            if batch is None:
                batch = nb
            else:
                batch.extend(nb)
                ops["extend"] += 1
            rows.extend(new)
            mx.eval(batch.keys, batch.values, batch.offset, batch.left_padding)
            t["prefill"] += time.perf_counter() - t0

        # ---- one decode step (L=1) for every row ----
        t0 = time.perf_counter()
        qs = [r.q[:, :, r.pos:r.pos + 1] for r in rows]
        ks = [r.k[:, :, r.pos:r.pos + 1] for r in rows]
        vs = [r.v[:, :, r.pos:r.pos + 1] for r in rows]
        qb = mx.concatenate(qs, axis=0)
        kb = mx.concatenate(ks, axis=0)
        vb = mx.concatenate(vs, axis=0)
        mx.eval(qb, kb, vb)
        t1 = time.perf_counter()
        t["inputs"] += t1 - t0

        mask = batch.make_mask(1)
        ops["batch_make_mask"] += 1
        Kb, Vb = batch.update_and_fetch(kb, vb)
        ops["batch_update"] += 1
        out_b = mx.fast.scaled_dot_product_attention(qb, Kb, Vb, scale=scale, mask=mask)
        ops["batch_sdpa"] += 1
        mx.eval(out_b, batch.keys, batch.values, batch.offset, batch.left_padding)
        t2 = time.perf_counter()
        t["batch"] += t2 - t1

        outs_s = [solo_attend(r.solo, qs[i], ks[i], vs[i], "decode") for i, r in enumerate(rows)]
        mx.eval(outs_s, [r.solo.keys for r in rows], [r.solo.values for r in rows])
        t3 = time.perf_counter()
        t["solo"] += t3 - t2

        # ---- verification: outputs and stored state, bitwise ----
        flags = []
        for i, r in enumerate(rows):
            ob, os_ = out_b[i:i + 1], outs_s[i]
            f_out = mx.array_equal(bits(ob), bits(os_))
            ext = batch.extract(i)
            verify_extracts += 1
            n = min(r.solo.offset, W)
            sk = r.solo._temporal_order(r.solo.keys)[..., -n:, :]
            sv = r.solo._temporal_order(r.solo.values)[..., -n:, :]
            f_state = mx.array_equal(bits(ext.keys), bits(sk)) & mx.array_equal(bits(ext.values), bits(sv))
            diff = mx.max(mx.abs(ob.astype(mx.float32) - os_.astype(mx.float32)))
            flags.append(mx.stack([f_out.astype(mx.float32), f_state.astype(mx.float32), diff]))
        res = mx.stack(flags).tolist()
        if args.diagnose:
            for i, (fo, fs, d) in enumerate(res):
                if fo == 1.0:
                    continue
                # A: batch row recomputed alone (B=1, same K/V buffer + mask row)
                mrow = mask[i:i + 1] if isinstance(mask, mx.array) else mask
                oa = mx.fast.scaled_dot_product_attention(
                    qs[i], Kb[i:i + 1], Vb[i:i + 1], scale=scale, mask=mrow)
                # B: solo recomputed with an explicit all-true bool mask
                Ks, Vs = r_kv = rows[i].solo.keys_and_values()
                ob_ = mx.fast.scaled_dot_product_attention(
                    qs[i], Ks, Vs, scale=scale, mask=mx.ones((1, 1, 1, Ks.shape[2]), dtype=mx.bool_))
                # C: valid keys of the batch row in the solo's physical order
                # (== solo state) but with the batch's buffer order -> temporal
                n = min(rows[i].solo.offset, W)
                Kt = rows[i].solo._temporal_order(Ks)[..., -n:, :]
                Vt = rows[i].solo._temporal_order(Vs)[..., -n:, :]
                oc = mx.fast.scaled_dot_product_attention(qs[i], Kt, Vt, scale=scale, mask=None)
                a, b, c, c2 = mx.stack([mx.array_equal(bits(oa), bits(out_b[i:i + 1])),
                                        mx.array_equal(bits(ob_), bits(outs_s[i])),
                                        mx.array_equal(bits(oc), bits(outs_s[i])),
                                        mx.array_equal(bits(oc), bits(out_b[i:i + 1]))]).tolist()
                diag["mismatch"] += 1
                diag["batch_row_alone_eq_batch"] += int(a)
                diag["solo_truemask_eq_solo"] += int(b)
                diag["solo_temporal_eq_solo"] += int(c)
                diag["solo_temporal_eq_batch"] += int(c2)
                diag["batch_rotated"] += int(bool(batch.rotated))
                diag["solo_rotated"] += int(rows[i].solo._idx < rows[i].solo.offset)
        for i, (fo, fs, d) in enumerate(res):
            n_cmp += 1
            n_out_eq += int(fo == 1.0)
            n_state_eq += int(fs == 1.0)
            max_abs_out = max(max_abs_out, d)
            if (fo != 1.0 or fs != 1.0) and first_mismatch is None:
                first_mismatch = dict(step=step, row=i, rid=rows[i].rid, pos=rows[i].pos,
                                      out_eq=fo == 1.0, state_eq=fs == 1.0, max_abs=d)
        t4 = time.perf_counter()
        t["verify"] += t4 - t3

        # ---- advance, finish rows: extract + filter ----
        done = []
        for i, r in enumerate(rows):
            r.pos += 1
            r.gen += 1
            if r.gen >= r.G:
                done.append(i)
        if done:
            finals = []
            for i in done:
                r = rows[i]
                ext = batch.extract(i)
                ops["extract"] += 1
                n = min(r.solo.offset, W)
                sk = r.solo._temporal_order(r.solo.keys)[..., -n:, :]
                sv = r.solo._temporal_order(r.solo.values)[..., -n:, :]
                ok = (ext.offset == r.solo.offset) and tuple(ext.keys.shape) == tuple(sk.shape)
                finals.append((ok, mx.array_equal(bits(ext.keys), bits(sk))
                               & mx.array_equal(bits(ext.values), bits(sv))))
            eqs = mx.stack([f for _, f in finals]).tolist()
            for (ok, _), e in zip(finals, eqs):
                n_final += 1
                n_final_eq += int(ok and bool(e))
            keep = [i for i in range(len(rows)) if i not in set(done)]
            for i in done:
                rows[i].solo = None
                rows[i].q = rows[i].k = rows[i].v = None
            finished += len(done)
            if keep:
                batch.filter(keep)
                ops["filter"] += 1
                rows = [rows[i] for i in keep]
                mx.eval(batch.keys, batch.values, batch.offset, batch.left_padding)
            else:
                batch = None
                rows = []
        t["finish"] += time.perf_counter() - t4
        steps_run += 1
    wall = time.perf_counter() - wall0

    res = dict(
        bench="sim", device=args.device, dtype=args.dtype, Hq=Hq, Hkv=Hkv, D=D, W=W,
        requests=args.requests, max_batch=args.max_batch, steps=args.steps, seed=args.seed,
        prompt_max=prompt_max, gen_max=gen_max, chunk=args.chunk or "rand[1,W]",
        steps_run=steps_run, admitted=admitted, finished=finished,
        cache_ops=sum(ops.values()), ops=ops, verify_extracts=verify_extracts,
        row_steps_compared=n_cmp, out_bitwise_equal=n_out_eq, state_bitwise_equal=n_state_eq,
        final_extract_checked=n_final, final_extract_equal=n_final_eq,
        max_abs_out_diff=max_abs_out, first_mismatch=first_mismatch,
        wall_s=round(wall, 4), time_s={k: round(v, 4) for k, v in t.items()},
        batch_ms_per_step=round(1000 * t["batch"] / max(1, steps_run), 4),
        solo_ms_per_row_step=round(1000 * t["solo"] / max(1, n_cmp), 4),
    )
    if args.diagnose:
        res["diagnose"] = diag
    res.update(env_info(args))
    return res


# --------------------------------------------------------------------------
# step microbenchmark
# --------------------------------------------------------------------------
def run_step(args):
    setup_device(args.device)
    dt = DTYPES[args.dtype]
    B, Hq, Hkv, D, W = args.batch, args.heads_q, args.heads_kv, args.head_dim, args.window
    scale = D ** -0.5
    mx.random.seed(args.seed)
    keys = mx.random.split(mx.random.key(args.seed), 8)
    cache = BatchRotatingKVCache(W, [0] * B)
    # fill the whole window with one concat update (prefill), then decode
    k0 = mx.random.normal((B, Hkv, W, D), key=keys[0]).astype(dt)
    v0 = mx.random.normal((B, Hkv, W, D), key=keys[1]).astype(dt)
    cache.update_and_fetch(k0, v0)
    mx.eval(cache.keys, cache.values, cache.offset, cache.left_padding)
    del k0, v0
    npool = 4
    qp = [mx.random.normal((B, Hq, 1, D), key=mx.random.key(100 + i)).astype(dt) for i in range(npool)]
    kp = [mx.random.normal((B, Hkv, 1, D), key=mx.random.key(200 + i)).astype(dt) for i in range(npool)]
    vp = [mx.random.normal((B, Hkv, 1, D), key=mx.random.key(300 + i)).astype(dt) for i in range(npool)]
    mx.eval(qp, kp, vp)

    def one(i):
        j = i % npool
        mask = cache.make_mask(1)
        K, V = cache.update_and_fetch(kp[j], vp[j])
        out = mx.fast.scaled_dot_product_attention(qp[j], K, V, scale=scale, mask=mask)
        mx.eval(out, cache.keys, cache.values, cache.offset, cache.left_padding)

    def timed(fn, warm, n, budget):
        for i in range(warm):
            fn(i)
        ts = []
        start = time.perf_counter()
        for i in range(n):
            t0 = time.perf_counter()
            fn(warm + i)
            ts.append(time.perf_counter() - t0)
            if len(ts) >= args.min_steps and time.perf_counter() - start > budget:
                break
        ts_ms = sorted(1000 * x for x in ts)
        return dict(n=len(ts_ms), mean=sum(ts_ms) / len(ts_ms), median=ts_ms[len(ts_ms) // 2],
                    min=ts_ms[0], p90=ts_ms[min(len(ts_ms) - 1, int(0.9 * len(ts_ms)))])

    full = timed(one, args.warmup, args.iters, args.budget_s)

    # component split: update only (cache op + eval), SDPA only (fixed K/V/mask)
    def upd(i):
        j = i % npool
        cache.make_mask(1)
        cache.update_and_fetch(kp[j], vp[j])
        mx.eval(cache.keys, cache.values, cache.offset, cache.left_padding)

    upd_t = timed(upd, args.warmup, args.iters, args.budget_s / 2)
    mask = cache.make_mask(1)
    K, V = cache.keys, cache.values
    mx.eval(mask)

    def sd(i):
        j = i % npool
        mx.eval(mx.fast.scaled_dot_product_attention(qp[j], K, V, scale=scale, mask=mask))

    sdpa_t = timed(sd, args.warmup, args.iters, args.budget_s / 2)

    nbytes = 2 * B * Hkv * W * D * (2 if dt != mx.float32 else 4)
    r2 = lambda x: round(x, 4)
    res = dict(
        bench="step", device=args.device, dtype=args.dtype, B=B, Hkv=Hkv, Hq=Hq, D=D, W=W,
        steps_timed=full["n"], warmup=args.warmup,
        ms_per_step=r2(full["mean"]), ms_median=r2(full["median"]), ms_min=r2(full["min"]),
        ms_p90=r2(full["p90"]),
        kv_bytes_per_step=nbytes,
        gbps_mean=r2(nbytes / (full["mean"] / 1e3) / 1e9),
        gbps_median=r2(nbytes / (full["median"] / 1e3) / 1e9),
        update_only_ms=r2(upd_t["mean"]), update_only_steps=upd_t["n"],
        sdpa_only_ms=r2(sdpa_t["mean"]), sdpa_only_steps=sdpa_t["n"],
        sdpa_only_gbps=r2(nbytes / (sdpa_t["mean"] / 1e3) / 1e9),
        cache_rotated=bool(cache.rotated), cache_shape=list(cache.keys.shape),
    )
    res.update(env_info(args))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--heads-q", type=int, default=4)
        p.add_argument("--heads-kv", type=int, default=2)
        p.add_argument("--head-dim", type=int, default=16)
        p.add_argument("--window", type=int, default=8)
        p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
        p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
        p.add_argument("--seed", type=int, default=0)

    ps = sub.add_parser("sim", help="continuous-batching batch-vs-solo bitwise check")
    common(ps)
    ps.add_argument("--requests", type=int, default=64)
    ps.add_argument("--max-batch", type=int, default=8)
    ps.add_argument("--steps", type=int, default=2000, help="max decode steps")
    ps.add_argument("--prompt-max", type=int, default=0, help="prompt len ~ U[1,max]; 0: 2W+3")
    ps.add_argument("--gen-max", type=int, default=0,
                    help="gen len ~ U[1,max]; 0: 2*steps*max_batch/requests")
    ps.add_argument("--chunk", type=int, default=0, help="prefill chunk; 0: random in [1,W]")
    ps.add_argument("--diagnose", action="store_true",
                    help="for output mismatches, recompute variants to locate the cause")
    ps.add_argument("--admit-per-step", type=int, default=0, help="0: fill all free slots")
    ps.add_argument("--schedule", default="",
                    help="a kvsim schedule (JSON: window, max_batch, steps, requests [[prompt, gen, chunks]]) "
                    "instead of this script's own draws")

    pt = sub.add_parser("step", help="decode-step microbenchmark")
    common(pt)
    pt.add_argument("--batch", "-B", type=int, default=8)
    pt.add_argument("--warmup", type=int, default=5)
    pt.add_argument("--iters", type=int, default=100, help="max timed steps")
    pt.add_argument("--min-steps", type=int, default=20)
    pt.add_argument("--budget-s", type=float, default=20.0,
                    help="stop timing after this many seconds once min-steps reached")
    args = ap.parse_args()
    res = run_sim(args) if args.cmd == "sim" else run_step(args)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
