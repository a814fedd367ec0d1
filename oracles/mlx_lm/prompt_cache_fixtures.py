"""Writes genuine mlx-lm 0.32.2 prompt-cache files (one per class) and mlx-lm's own continuation of each.

Run with the oracle venv (oracles/mlx_lm/setup.sh):

    oracles/mlx_lm/.venv/bin/python oracles/mlx_lm/prompt_cache_fixtures.py tests/fixtures/mlxlm

For each fixture NAME it writes, into the output folder:
- NAME.safetensors: `save_prompt_cache` of the cache (small shapes, a few KB);
- for classes kvsim continues: NAME.io.safetensors (the continuation's inputs `k.<i>`, `v.<i>`, `q.<i>` and mlx-lm's
  attention outputs `out.<i>`) and NAME.continued.safetensors (`save_prompt_cache` after the continuation);
- manifest.json: per fixture the class, the continuation steps, the SDPA scale, and each mlx-lm load bug met on the
  loaded cache (the exception text) with the workaround used to continue it anyway.

With `--check-kvsim-written DIR` it runs the other direction instead: it loads the files kvsim wrote
(DIR/kvsim-written/NAME.safetensors), continues them in mlx-lm with the same inputs and compares the outputs with
mlx-lm's own continuation of its own file, writing DIR/kvsim-written.json.

The continuation follows how mlx-lm models call a cache: the mask is asked for before `update_and_fetch`
(`make_mask(N)` / `create_attention_mask`), then `mx.fast.scaled_dot_product_attention` reads what
`update_and_fetch` returned. Everything is deterministic (fixed PRNG keys), so running it again writes the same bytes.
"""

import json
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402  (imports mlx_lm.models.{base,cache} without the package __init__)
import importlib  # noqa: E402

import mlx.nn as nn  # noqa: E402

_BASE, _CACHE = driver.BASE, driver.CACHE
# mlx-lm 0.32.2 `mlx_lm/models/gated_delta.py` (normalize_qk, gated_delta_update), through the same stand-in package.
_GDN = importlib.import_module("mlx_lm.models.gated_delta")
create_attention_mask = _CACHE.create_attention_mask
ArraysCache, BatchKVCache, BatchRotatingKVCache = _CACHE.ArraysCache, _CACHE.BatchKVCache, _CACHE.BatchRotatingKVCache
CacheList, ChunkedKVCache, KVCache = _CACHE.CacheList, _CACHE.ChunkedKVCache, _CACHE.KVCache
QuantizedKVCache, RotatingKVCache = _CACHE.QuantizedKVCache, _CACHE.RotatingKVCache
load_prompt_cache, save_prompt_cache = _CACHE.load_prompt_cache, _CACHE.save_prompt_cache

mx.set_default_device(mx.cpu)
H, D, HQ = 2, 4, 4
DT = mx.bfloat16
SCALE = 0.5
_key = [0]


def rnd(shape, dtype=DT):
    _key[0] += 1
    return mx.random.normal(shape, key=mx.random.key(_key[0])).astype(dtype)


def feed(c, L, B=1):
    c.update_and_fetch(rnd((B, H, L, D)), rnd((B, H, L, D)))


def mask_for(c, L):
    """The mask an mlx-lm attention layer asks for before writing L positions."""
    if isinstance(c, (BatchKVCache, BatchRotatingKVCache)):
        return c.make_mask(L)
    if isinstance(c, RotatingKVCache):
        return c.make_mask(L)
    return create_attention_mask(L, c.offset, False, None) if L > 1 else None


def attend(c, q, ks, vs, scale, mask):
    """The read an mlx-lm attention layer does over what `update_and_fetch` returned (`base.scaled_dot_product_attention`
    picks the quantized path for a QuantizedKVCache)."""
    if isinstance(c, QuantizedKVCache):
        # It scales the queries in place (`queries *= scale`): hand it a copy so the recorded `q.<i>` stay the inputs.
        return _BASE.quantized_scaled_dot_product_attention(
            q * 1, ks, vs, scale=scale, mask=mask, group_size=c.group_size, bits=c.bits)
    return mx.fast.scaled_dot_product_attention(q, ks, vs, scale=scale, mask=mask)


# One gated-DeltaNet layer's geometry (kvsim's `SsmSpec`): kernel K, key heads Hk, value heads Hv, Dk, Dv.
GDN = {"kernel": 4, "heads_k": 2, "heads_v": 4, "dk": 8, "dv": 4}
CONV_DIM = 2 * GDN["heads_k"] * GDN["dk"] + GDN["heads_v"] * GDN["dv"]


def gdn_params():
    """The layer weights the cache-side arithmetic reads: the depthwise conv weight `[conv_dim, K, 1]` (nn.Conv1d's
    layout after mlx-lm's `sanitize`), `A_log` and `dt_bias` `[Hv]` (f32, as mlx-lm initializes them)."""
    return {
        "conv_weight": (rnd((CONV_DIM, GDN["kernel"], 1)) * 0.5).astype(DT),
        "A_log": rnd((GDN["heads_v"],), mx.float32) * 0.5,
        "dt_bias": rnd((GDN["heads_v"],), mx.float32) * 0.5,
    }


def gdn_layer(c, qkv, a, b, p):
    """The cache side of mlx-lm 0.32.2's `GatedDeltaNet.__call__` (`mlx_lm/models/qwen3_5.py`) after the input
    projections, unpadded (no mask, `lengths` None): conv state ++ qkv, the new conv tail, the depthwise conv
    (`nn.Conv1d(groups=conv_dim, bias=False)`, i.e. `mx.conv1d`) and silu, the split, `normalize_qk`, and
    `gated_delta_update` (its ops path: this runs on the CPU). Returns `y [B, S, Hv, Dv]` (before the gated norm and
    the output projection, which are not the cache's business)."""
    B, S, _ = qkv.shape
    K = GDN["kernel"]
    conv_state = c[0] if c[0] is not None else mx.zeros((B, K - 1, CONV_DIM), dtype=qkv.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    c[0] = mx.contiguous(conv_input[:, -(K - 1):, :])
    conv_out = nn.silu(mx.conv1d(conv_input, p["conv_weight"], groups=CONV_DIM))
    kd = GDN["heads_k"] * GDN["dk"]
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [kd, 2 * kd], -1),
            [GDN["heads_k"], GDN["heads_k"], GDN["heads_v"]],
            [GDN["dk"], GDN["dk"], GDN["dv"]],
        )
    ]
    q, k = _GDN.normalize_qk(q, k, inv_scale=GDN["dk"] ** -0.5, eps=1e-6)
    y, state = _GDN.gated_delta_update(q, k, v, a, b, p["A_log"], p["dt_bias"], c[1], None, use_kernel=False)
    c[1] = state
    c.advance(S)
    return y


def gdn_inputs(B, L):
    return rnd((B, L, CONV_DIM)), rnd((B, L, GDN["heads_v"])), rnd((B, L, GDN["heads_v"]))


def continue_cache(c, steps, B, d=D, params=None):
    """mlx-lm's continuation of `c` (one cache object: attention, ArraysCache or CacheList), recorded per step.
    Keys: attention `k.<i>`, `v.<i>`, `q.<i>`, `out.<i>`; gated DeltaNet `qkv.<i>`, `a.<i>`, `b.<i>`, `y.<i>` and
    the layer's weights; a CacheList child `j` prefixes its keys with `c<j>.`."""
    io = {}
    for i, L in enumerate(steps):
        step_layer(c, i, L, B, d, params, io, "", None)
    mx.eval(io)
    return io


def step_layer(c, i, L, B, d, params, io, prefix, given):
    """One step of one cache object. `given` (an io dict) replays recorded inputs instead of drawing new ones."""
    if isinstance(c, CacheList):
        for j, child in enumerate(c.caches):
            step_layer(child, i, L, B, d, params, io, f"{prefix}c{j}.", given)
        return
    if isinstance(c, ArraysCache):
        p = params[prefix]
        for name, x in p.items():
            io[f"{prefix}{name}"] = x
        if given is None:
            qkv, a, b = gdn_inputs(B, L)
        else:
            qkv, a, b = (given[f"{prefix}{n}.{i}"] for n in ("qkv", "a", "b"))
        y = gdn_layer(c, qkv, a, b, p)
        io.update({f"{prefix}qkv.{i}": qkv, f"{prefix}a.{i}": a, f"{prefix}b.{i}": b, f"{prefix}y.{i}": y})
        return
    if isinstance(c, ChunkedKVCache):
        # llama4 (`mlx_lm/models/llama4.py`, `LlamaModel.__call__`) trims a chunked cache's front before every forward.
        c.maybe_trim_front()
    if given is None:
        k, v, q = rnd((B, H, L, d)), rnd((B, H, L, d)), rnd((B, HQ, L, d))
    else:
        k, v, q = (given[f"{prefix}{n}.{i}"] for n in ("k", "v", "q"))
    mask = mask_for(c, L)
    ks, vs = c.update_and_fetch(k, v)
    out = attend(c, q, ks, vs, SCALE, mask)
    io.update({f"{prefix}k.{i}": k, f"{prefix}v.{i}": v, f"{prefix}q.{i}": q, f"{prefix}out.{i}": out})


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    manifest = {}

    def save(name, caches, steps=None, B=1, bugs=None, d=D, params=None, extra=None, extra_continued=None):
        path = os.path.join(out_dir, f"{name}.safetensors")
        meta = {"model": "kvsim-fixture", "fixture": name}
        meta.update(extra or {})
        save_prompt_cache(path, caches, meta)
        entry = {"class": type(caches[0]).__name__, "batch": B}
        if steps is not None:
            loaded = load_prompt_cache(path)
            c = loaded[0]
            entry["bugs"] = bugs(c) if bugs else []
            io = continue_cache(c, steps, B, d, params)
            mx.save_safetensors(os.path.join(out_dir, f"{name}.io.safetensors"), io)
            save_prompt_cache(os.path.join(out_dir, f"{name}.continued.safetensors"), loaded, extra_continued or {})
            entry.update({"steps": steps, "scale": SCALE})
            if params:
                entry["gdn"] = GDN
        manifest[name] = entry

    # KVCache: 5 prefilled + 2 decoded positions (a 256-column buffer).
    c = KVCache()
    feed(c, 5)
    feed(c, 1)
    feed(c, 1)
    save("kv_cache", [c], steps=[1, 1, 3, 1])

    # RotatingKVCache(4, keep 0), wrapped: 3 + 3 decodes (offset 6, ring rotated).
    c = RotatingKVCache(max_size=4, keep=0)
    feed(c, 3)
    for _ in range(3):
        feed(c, 1)
    save("rotating_kv_cache", [c], steps=[1, 1, 1, 2, 1, 1])

    # RotatingKVCache right after a window write (the oversized W - 1 + L buffer).
    c = RotatingKVCache(max_size=4, keep=0)
    feed(c, 3)
    feed(c, 1)
    feed(c, 1)
    feed(c, 3)
    save("rotating_kv_cache_oversized", [c], steps=[1, 1, 2])

    # QuantizedKVCache(group 32, 4 bits), D = 32. Its continuation draws from keys 10001.. so that every later
    # fixture keeps the bytes it had before the continuation was added.
    q = QuantizedKVCache(group_size=32, bits=4)
    q.update_and_fetch(rnd((1, H, 3, 32)), rnd((1, H, 3, 32)))
    resume, _key[0] = _key[0], 10_000
    save("quantized_kv_cache", [q], steps=[1, 1, 3, 1], d=32)
    _key[0] = resume

    # ArraysCache(2): a gated-DeltaNet layer's [conv tail, recurrent state] after 5 + 1 positions run through
    # mlx-lm's own layer arithmetic (`gdn_layer`), then continued. ArraysCache carries no offset: the row offsets go
    # in the user metadata key `kvsim_ssm_offsets` (JSON: layer path -> per-row offsets), which kvsim requires. Draws
    # from keys 20001.. (and consumes the two keys the earlier file-level fixture drew), so every later fixture keeps
    # its bytes.
    resume, _key[0] = _key[0], 20_000
    a = ArraysCache(2)
    p = gdn_params()
    for L in (5, 1):
        gdn_layer(a, *gdn_inputs(1, L), p)
    save("arrays_cache", [a], steps=[1, 1, 3, 1], params={"": p},
         extra={"kvsim_ssm_offsets": json.dumps({"0": [6]})},
         extra_continued={"kvsim_ssm_offsets": json.dumps({"0": [12]})})
    _key[0] = resume + 2

    # BatchKVCache: merge of 3- and 5-position caches, then 2 decodes.
    c1, c2 = KVCache(), KVCache()
    feed(c1, 3)
    feed(c2, 5)
    b = BatchKVCache.merge([c1, c2])
    feed(b, 1, B=2)
    feed(b, 1, B=2)

    def batch_kv_bugs(c):
        try:
            c.finalize()
            return []
        except AttributeError as e:
            c._right_padding = None  # workaround: the attribute the loaded cache lacks
            return [{"bug": "loaded BatchKVCache cannot finalize", "error": f"AttributeError: {e}",
                     "workaround": "_right_padding = None"}]

    save("batch_kv_cache", [b], steps=[1, 1, 2, 1], B=2, bugs=batch_kv_bugs)

    # BatchRotatingKVCache(4): merge of a 2-position ring and a wrapped 5-position ring, 3 decodes (rotated).
    r1, r2 = RotatingKVCache(max_size=4), RotatingKVCache(max_size=4)
    feed(r1, 2)
    feed(r2, 3)
    feed(r2, 1)
    feed(r2, 1)
    b = BatchRotatingKVCache.merge([r1, r2])
    for _ in range(3):
        feed(b, 1, B=2)

    def batch_rot_bugs(c):
        try:
            c.update_and_fetch(mx.zeros((2, H, 1, D), DT), mx.zeros((2, H, 1, D), DT))
            raise SystemExit("mlx-lm 0.32.2 was expected to fail here; the fixture's assumptions changed")
        except AttributeError as e:
            c._lengths = None  # workaround: the attribute the loaded cache lacks
            return [{"bug": "loaded BatchRotatingKVCache cannot update", "error": f"AttributeError: {e}",
                     "workaround": "_lengths = None"}]

    save("batch_rotating_kv_cache", [b], steps=[1, 1, 2, 1], B=2, bugs=batch_rot_bugs)

    # ChunkedKVCache(4) after 6 positions, its front trimmed (start_position 2), then continued as llama4 drives
    # it: `maybe_trim_front` before every forward, `update_and_fetch`, a causal read of what it returned. Keys 30001..
    _key[0] = 30_000
    ch = ChunkedKVCache(4)
    feed(ch, 6)
    ch.maybe_trim_front()
    save("chunked_kv_cache", [ch], steps=[1, 2, 1, 3, 1])

    # CacheList(ArraysCache(2), KVCache): a hybrid layer (a DeltaNet state beside an attention cache), both continued
    # step by step. Keys 40001..
    _key[0] = 40_000
    a = ArraysCache(2)
    p = gdn_params()
    gdn_layer(a, *gdn_inputs(1, 3), p)
    kv = KVCache()
    feed(kv, 3)
    save("cache_list", [CacheList(a, kv)], steps=[1, 2, 1], params={"c0.": p},
         extra={"kvsim_ssm_offsets": json.dumps({"0.0": [3]})},
         extra_continued={"kvsim_ssm_offsets": json.dumps({"0.0": [7]})})

    # Three files mlx-lm writes that carry less than kvsim needs, with no kvsim metadata (keys 50001..):
    # - a hybrid model's cache, [ArraysCache (a DeltaNet state), KVCache] twice: the ArraysCache layers carry no
    #   offsets, the attention layers (which saw the same 5 tokens) do;
    # - a list whose second layer is an empty KVCache (a layer before any token: a class name and no array);
    # - a Mamba layer's ArraysCache (conv [1, 3, 32], ssm [1, 32, 16]): no kvsim layout maps it (a Mamba2-shaped one
    #   follows below).
    _key[0] = 50_000
    layers = []
    for _ in range(2):
        a = ArraysCache(2)
        a[0] = rnd((1, 3, 48))
        a[1] = rnd((1, 2, 8, 8), mx.float32)
        kv = KVCache()
        kv.update_and_fetch(rnd((1, H, 5, 8)), rnd((1, H, 5, 8)))
        layers += [a, kv]
    save("hybrid_model", layers)
    kv = KVCache()
    feed(kv, 3)
    save("empty_layer_list", [kv, KVCache()])
    m = ArraysCache(2)
    m[0] = rnd((1, 3, 32))
    m[1] = rnd((1, 32, 16), mx.float32)
    save("mamba_arrays_cache", [m])

    # A Mamba2-shaped ArraysCache (mlx-lm 0.32.2 `mamba2.py`: `cache[0]` the conv tail [B, K-1, conv_dim], `cache[1]`
    # the SSM state [B, H, Dh, N], f32) whose conv width, 40, is not 2 Hk Dk + Hv Dv for the state's H 4, Dh 8, N 16
    # read as a gated-DeltaNet state (32 + 32 Hk): four dimensions beside a conv tail, yet no kvsim layout maps it.
    # `inspect` describes it; converting it to kvsim is refused with a typed error. Keys 60001..
    _key[0] = 60_000
    m2 = ArraysCache(2)
    m2[0] = rnd((1, 3, 40))
    m2[1] = rnd((1, 4, 8, 16), mx.float32)
    save("mamba2_arrays_cache", [m2])

    # ConcatenateKVCache (mlx-lm's simplest cache: state (keys, values), exactly the positions written) after 3 + 1
    # positions. Keys 70001..
    _key[0] = 70_000
    cc = _CACHE.ConcatenateKVCache()
    feed(cc, 3)
    feed(cc, 1)
    save("concatenate_kv_cache", [cc])

    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(manifest)} fixtures to {out_dir}")


def check_kvsim_written(fixtures):
    """The other direction: files kvsim wrote (fixtures/kvsim-written/NAME.safetensors, kvsim's mlx-lm form of the
    fixture NAME after loading it into kvsim layouts) load in mlx-lm and continue there. Compares mlx-lm's outputs
    with those it recorded for its own file (NAME.io.safetensors), byte for byte, and writes kvsim-written.json."""
    with open(os.path.join(fixtures, "manifest.json")) as f:
        manifest = json.load(f)
    report = {}
    for name, e in sorted(manifest.items()):
        path = os.path.join(fixtures, "kvsim-written", f"{name}.safetensors")
        if "steps" not in e or not os.path.exists(path):
            continue
        c = load_prompt_cache(path)[0]
        bugs = []
        if isinstance(c, BatchKVCache) and not hasattr(c, "_right_padding"):
            c._right_padding = None
            bugs.append("loaded BatchKVCache lacks _right_padding (set to None)")
        if isinstance(c, BatchRotatingKVCache) and not hasattr(c, "_lengths"):
            c._lengths = None
            bugs.append("loaded BatchRotatingKVCache lacks _lengths (set to None)")
        io = mx.load(os.path.join(fixtures, f"{name}.io.safetensors"))
        params = {}
        for key in io:
            for pn in ("conv_weight", "A_log", "dt_bias"):
                if key.endswith(pn):
                    params.setdefault(key[: -len(pn)], {})[pn] = io[key]
        steps = []
        for i, L in enumerate(e["steps"]):
            got = {}
            step_layer(c, i, L, e["batch"], None, params, got, "", io)
            outs = sorted(k for k in got if k.count(".") >= 1 and k.rsplit(".", 2)[-2] in ("out", "y"))
            same = all(bool(mx.all(got[k].view(mx.uint16) == io[k].view(mx.uint16)).item()) for k in outs)
            diff = max(float(mx.max(mx.abs(got[k].astype(mx.float32) - io[k].astype(mx.float32))).item()) for k in outs)
            steps.append({"L": L, "bit_identical": same, "max_abs_diff": diff, "outputs": outs})
        report[name] = {"class": type(c).__name__, "load_bugs_worked_around": bugs, "steps": steps}
    with open(os.path.join(fixtures, "kvsim-written.json"), "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
        f.write("\n")
    print(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--check-kvsim-written":
        check_kvsim_written(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/mlxlm")
