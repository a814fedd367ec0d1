#!/usr/bin/env python3
"""mlx-lm 0.32.2: [rows_trim_vs_solo] after 12 scheduler ops (kvsim seed 92)

Written by kvsim check-engine from a shrunk trace: mlx-lm's own caches, the calls kvsim made, and the
divergence it found. Exits 1 and prints the divergence while it is there; 0 once it is gone.
"""
import os
import sys

# ---- core: begin (copied verbatim into every reproducer; imports only the standard library, mlx and mlx_lm) ----
import base64
import importlib
import importlib.util
import json
import struct
import types

import mlx.core as mx

PROTOCOL = 1


def load_mlx_lm():
    """`mlx_lm.models.base` and `.cache` without running `mlx_lm/__init__.py` (which needs transformers)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("mlx_lm is not installed")
    root = next(iter(spec.submodule_search_locations))
    for name, path in (("mlx_lm", root), ("mlx_lm.models", os.path.join(root, "models"))):
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [path]
            stub.__package__ = name
            sys.modules[name] = stub
    return importlib.import_module("mlx_lm.models.base"), importlib.import_module("mlx_lm.models.cache")


BASE, CACHE = load_mlx_lm()
DTYPES = {"f32": (mx.float32, mx.uint32, "I", 4), "bf16": (mx.bfloat16, mx.uint16, "H", 2)}
NAMES = {mx.float32: "f32", mx.bfloat16: "bf16"}


def arr_in(a):
    """`{"dtype", "shape", "b64"}` -> an mx.array with exactly those element bits."""
    dt, _, fmt, size = DTYPES[a["dtype"]]
    shape = [int(s) for s in a["shape"]]
    raw = base64.b64decode(a["b64"], validate=True)
    n = 1
    for s in shape:
        n *= s
    if len(raw) != n * size:
        raise ValueError(f"array of shape {shape} {a['dtype']} needs {n * size} bytes, b64 holds {len(raw)}")
    if n == 0:
        return mx.zeros(shape, dtype=dt)
    return mx.array(memoryview(raw).cast(fmt)).reshape(shape).view(dt)


def raw_of(x):
    """Row-major little-endian element bytes."""
    if x.size == 0:
        return b""
    _, udt, _, _ = DTYPES[NAMES[x.dtype]]
    return memoryview(mx.contiguous(x.view(udt))).tobytes()


def arr_out(x):
    return {"dtype": NAMES[x.dtype], "shape": list(x.shape), "b64": base64.b64encode(raw_of(x)).decode()}


class Engine:
    """mlx-lm's caches by the ids kvsim gives them."""

    def __init__(self):
        self.caches = {}
        self.geometry = None

    def handle(self, req):
        for i in req.get("free", []):
            self.caches.pop(i, None)
        f = getattr(self, "op_" + str(req.get("op")), None)
        if f is None:
            return {"ok": False, "error": f"unknown op {req.get('op')!r}"}
        try:
            out = f(req)
        except Exception as e:  # the cache under test raised: reported, never hidden
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out["ok"] = True
        return out

    def op_hello(self, r):
        from importlib import metadata

        return {
            "protocol": PROTOCOL,
            "engine": "mlx-lm",
            "version": metadata.version("mlx-lm"),
            "mlx": metadata.version("mlx"),
            "supports": {"serial_trim": True, "rows_window": True, "rows_trim": True, "join": False, "rotating": True},
        }

    def op_reset(self, r):
        self.caches = {}
        return {}

    def op_new(self, r):
        self.geometry = r["geometry"]
        w = self.geometry.get("max_size")
        self.caches[r["id"]] = CACHE.RotatingKVCache(max_size=w, keep=0) if w else CACHE.KVCache()
        return {}

    def read(self, c, r):
        k, v, q = arr_in(r["k"]), arr_in(r["v"]), arr_in(r["q"])
        # the mask of the cache before the write, as a model's forward builds it (base.create_attention_mask)
        mask = BASE.create_attention_mask(q.transpose(0, 2, 1, 3), c, window_size=self.geometry.get("max_size"))
        keys, values = c.update_and_fetch(k, v)
        out = BASE.scaled_dot_product_attention(q, keys, values, c, scale=r["scale"], mask=mask)
        return {"out": arr_out(out)}

    def op_window(self, r):
        return self.read(self.caches[r["id"]], r)

    op_decode = op_window
    op_rows_window = op_window
    op_rows_decode = op_window

    def op_trim(self, r):
        return {"trimmed": CACHE.trim_prompt_cache([self.caches[r["id"]]], r["n"])}

    op_rows_trim = op_trim

    def state_of(self, c):
        """The K/V the next read attends, oldest first: the first `offset` columns of a KVCache; the newest
        min(offset, W) of a RotatingKVCache in temporal order (its `_temporal_order`)."""
        g = self.geometry
        if c.keys is None:
            empty = mx.zeros([1, g["heads_kv"], 0, g["head_dim"]], dtype=DTYPES[g["dtype"]][0])
            return {"k": arr_out(empty), "v": arr_out(empty)}
        w = g.get("max_size")
        if not w:
            return {"k": arr_out(c.keys[..., : c.offset, :]), "v": arr_out(c.values[..., : c.offset, :])}
        k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
        n = max(0, min(c.offset, w, k.shape[2]))
        return {"k": arr_out(k[..., k.shape[2] - n :, :]), "v": arr_out(v[..., v.shape[2] - n :, :])}

    def op_state(self, r):
        return self.state_of(self.caches[r["id"]])

    def op_offset(self, r):
        return {"offset": int(self.caches[r["id"]].offset)}

    def op_merge(self, r):
        rows = [self.caches.pop(i) for i in r["rows"]]
        self.caches[r["id"]] = rows[0].merge(rows)
        return {}

    def op_extend(self, r):
        self.caches[r["id"]].extend(self.caches.pop(r["other"]))
        return {}

    def op_rows_info(self, r):
        offsets = [int(o) for o in self.caches[r["id"]].offset.tolist()]
        return {"rows": len(offsets), "offsets": offsets}

    def op_extract(self, r):
        self.caches[r["new"]] = self.caches[r["id"]].extract(r["row"])
        return {}

    def op_filter(self, r):
        self.caches[r["id"]].filter(r["keep"])
        return {}

    def op_rows_state(self, r):
        return self.state_of(self.caches[r["id"]].extract(r["row"]))


CALLS = json.loads('[{"geometry":{"dtype":"bf16","head_dim":4,"heads_kv":2,"heads_q":4,"max_size":6},"id":1,"op":"new"},{"geometry":{"dtype":"bf16","head_dim":4,"heads_kv":2,"heads_q":4,"max_size":6},"id":2,"op":"new"},{"id":1,"op":"offset"},{"id":1,"op":"state"},{"id":2,"op":"state"},{"geometry":{"dtype":"bf16","head_dim":4,"heads_kv":2,"heads_q":4,"max_size":6},"id":3,"op":"new"},{"geometry":{"dtype":"bf16","head_dim":4,"heads_kv":2,"heads_q":4,"max_size":6},"id":4,"op":"new"},{"id":1,"op":"offset"},{"id":1,"op":"state"},{"id":2,"op":"state"},{"id":3,"op":"offset"},{"id":3,"op":"state"},{"id":4,"op":"state"},{"id":3,"k":{"b64":"HD8Nv3k/Sr8NPiu/rj6UvmO/aD8Zvn2/rz45P2U+Cj/TPog+tj4Fv1k/yL4evwc/","dtype":"bf16","shape":[1,2,3,4]},"op":"window","q":{"b64":"Ar8Hv969YT++vmq/8T61Pt4+ML8svY68GL8sv2s/jL5ovz+/Yr+Evre+Jr55P4A9db8SvnA/Ej/dvl4/HD9jv2W/pr4vvim/Qj9dv72+UL8Wv1S/ED+avl4+G793vfc+","dtype":"bf16","shape":[1,4,3,4]},"scale":0.5,"v":{"b64":"y76VPec+2L5av5++Kz5Kvgi95b4Avxo9Nj4gvzy/Q78GvmC/ij5KPsq+a7/uPn+/","dtype":"bf16","shape":[1,2,3,4]}},{"id":4,"k":{"b64":"HD8Nv3k/Sr8NPiu/rj6UvmO/aD8Zvn2/rz45P2U+Cj/TPog+tj4Fv1k/yL4evwc/","dtype":"bf16","shape":[1,2,3,4]},"op":"window","q":{"b64":"Ar8Hv969YT++vmq/8T61Pt4+ML8svY68GL8sv2s/jL5ovz+/Yr+Evre+Jr55P4A9db8SvnA/Ej/dvl4/HD9jv2W/pr4vvim/Qj9dv72+UL8Wv1S/ED+avl4+G793vfc+","dtype":"bf16","shape":[1,4,3,4]},"scale":0.5,"v":{"b64":"y76VPec+2L5av5++Kz5Kvgi95b4Avxo9Nj4gvzy/Q78GvmC/ij5KPsq+a7/uPn+/","dtype":"bf16","shape":[1,2,3,4]}},{"id":1,"op":"offset"},{"id":1,"op":"state"},{"id":2,"op":"state"},{"id":3,"op":"offset"},{"id":3,"op":"state"},{"id":4,"op":"state"},{"id":5,"op":"merge","rows":[3,1]},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_state","row":1},{"id":2,"op":"state"},{"id":5,"op":"rows_state","row":0},{"id":4,"op":"state"},{"geometry":{"dtype":"bf16","head_dim":4,"heads_kv":2,"heads_q":4,"max_size":6},"id":6,"op":"new"},{"geometry":{"dtype":"bf16","head_dim":4,"heads_kv":2,"heads_q":4,"max_size":6},"id":7,"op":"new"},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_state","row":1},{"id":2,"op":"state"},{"id":5,"op":"rows_state","row":0},{"id":4,"op":"state"},{"id":6,"op":"offset"},{"id":6,"op":"state"},{"id":7,"op":"state"},{"id":8,"op":"merge","rows":[6]},{"id":5,"keep":[0,1],"op":"filter"},{"id":5,"op":"extend","other":8},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_state","row":1},{"id":2,"op":"state"},{"id":5,"op":"rows_state","row":0},{"id":4,"op":"state"},{"id":5,"op":"rows_state","row":2},{"id":7,"op":"state"},{"id":5,"k":{"b64":"rT5tvxW/TT8/P0g/Nr4pPg2/6j1gP729eT+gvtS9ZD9GP8U7zj19P+e+KL/FPQ++","dtype":"bf16","shape":[3,2,1,4]},"op":"rows_decode","q":{"b64":"qj5jPha/dz+HPls/QT8aP5s+oz6pPVs/QD/APkW/9T54Pi6/Eb+lPZe+I7/1Phq/lL7DPjS+Wz9ovwI7eb33PiI/aj+KPXs/GD1KP0+9PL9ov8k+kb5Tv14+1b43PVY/","dtype":"bf16","shape":[3,4,1,4]},"scale":0.5,"v":{"b64":"Ez9SP1y/gT4DP58+WD6Wvk+/Aj/svkI/KT+RvhG/KD85v0k/9D5DP98+sr5VPzu/","dtype":"bf16","shape":[3,2,1,4]}},{"id":4,"k":{"b64":"rT5tvxW/TT8/P0g/Nr4pPg==","dtype":"bf16","shape":[1,2,1,4]},"op":"decode","q":{"b64":"qj5jPha/dz+HPls/QT8aP5s+oz6pPVs/QD/APkW/9T4=","dtype":"bf16","shape":[1,4,1,4]},"scale":0.5,"v":{"b64":"Ez9SP1y/gT4DP58+WD6Wvg==","dtype":"bf16","shape":[1,2,1,4]}},{"id":2,"k":{"b64":"Db/qPWA/vb15P6C+1L1kPw==","dtype":"bf16","shape":[1,2,1,4]},"op":"decode","q":{"b64":"eD4uvxG/pT2XviO/9T4av5S+wz40vls/aL8CO3m99z4=","dtype":"bf16","shape":[1,4,1,4]},"scale":0.5,"v":{"b64":"T78CP+y+Qj8pP5G+Eb8oPw==","dtype":"bf16","shape":[1,2,1,4]}},{"id":7,"k":{"b64":"Rj/FO849fT/nvii/xT0Pvg==","dtype":"bf16","shape":[1,2,1,4]},"op":"decode","q":{"b64":"Ij9qP4o9ez8YPUo/T708v2i/yT6RvlO/Xj7Vvjc9Vj8=","dtype":"bf16","shape":[1,4,1,4]},"scale":0.5,"v":{"b64":"Ob9JP/Q+Qz/fPrK+VT87vw==","dtype":"bf16","shape":[1,2,1,4]}},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_state","row":1},{"id":2,"op":"state"},{"id":5,"op":"rows_state","row":0},{"id":4,"op":"state"},{"id":5,"op":"rows_state","row":2},{"id":7,"op":"state"},{"id":5,"keep":[2,0],"op":"filter"},{"free":[2],"id":5,"op":"rows_info"},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_state","row":1},{"id":4,"op":"state"},{"id":5,"op":"rows_state","row":0},{"id":7,"op":"state"},{"id":5,"k":{"b64":"3j5HvS6/dr+SvkA/kb4cvm0/ST0uP42+ZD/5Pii+aL8=","dtype":"bf16","shape":[2,2,1,4]},"op":"rows_decode","q":{"b64":"Jj4pv+A+9r54vp694b0Xv30/Nr8Yv4G+27tlv5+9eT+sPLi+gj6fPhS/U78Xv8i+2r5YPjC+0b5kvg6/3D6Mvg==","dtype":"bf16","shape":[2,4,1,4]},"scale":0.5,"v":{"b64":"Qr9iviA9/j1ev7S+wL1hvpc+67wKP6M9Kr6JPSk+X78=","dtype":"bf16","shape":[2,2,1,4]}},{"id":7,"k":{"b64":"3j5HvS6/dr+SvkA/kb4cvg==","dtype":"bf16","shape":[1,2,1,4]},"op":"decode","q":{"b64":"Jj4pv+A+9r54vp694b0Xv30/Nr8Yv4G+27tlv5+9eT8=","dtype":"bf16","shape":[1,4,1,4]},"scale":0.5,"v":{"b64":"Qr9iviA9/j1ev7S+wL1hvg==","dtype":"bf16","shape":[1,2,1,4]}},{"id":4,"k":{"b64":"bT9JPS4/jb5kP/k+KL5ovw==","dtype":"bf16","shape":[1,2,1,4]},"op":"decode","q":{"b64":"rDy4voI+nz4Uv1O/F7/Ivtq+WD4wvtG+ZL4Ov9w+jL4=","dtype":"bf16","shape":[1,4,1,4]},"scale":0.5,"v":{"b64":"lz7rvAo/oz0qvok9KT5fvw==","dtype":"bf16","shape":[1,2,1,4]}},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_state","row":1},{"id":4,"op":"state"},{"id":5,"op":"rows_state","row":0},{"id":7,"op":"state"},{"id":5,"new":9,"op":"extract","row":1},{"id":5,"keep":[0],"op":"filter"},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_info"},{"id":9,"op":"offset"},{"id":9,"op":"state"},{"id":4,"op":"state"},{"id":5,"op":"rows_state","row":0},{"id":7,"op":"state"},{"id":5,"k":{"b64":"or2Vvmg/QD/qPnG/Jb81Pw==","dtype":"bf16","shape":[1,2,1,4]},"op":"rows_window","q":{"b64":"QT8avwg/Er82P3Q/PD+uPak+qj4fvhk/ej8NP2G/RD8=","dtype":"bf16","shape":[1,4,1,4]},"scale":0.5,"v":{"b64":"cL9Dv/c+Y7/uvti+YL5fvw==","dtype":"bf16","shape":[1,2,1,4]}},{"id":7,"k":{"b64":"or2Vvmg/QD/qPnG/Jb81Pw==","dtype":"bf16","shape":[1,2,1,4]},"op":"window","q":{"b64":"QT8avwg/Er82P3Q/PD+uPak+qj4fvhk/ej8NP2G/RD8=","dtype":"bf16","shape":[1,4,1,4]},"scale":0.5,"v":{"b64":"cL9Dv/c+Y7/uvti+YL5fvw==","dtype":"bf16","shape":[1,2,1,4]}},{"id":5,"op":"rows_info"},{"id":5,"op":"rows_info"},{"id":9,"op":"offset"},{"id":9,"op":"state"},{"id":4,"op":"state"},{"id":5,"op":"rows_state","row":0},{"id":7,"op":"state"},{"id":7,"n":1,"op":"trim"},{"id":5,"n":1,"op":"rows_trim"}]')
DIVERGENCE = 'rows_trim_vs_solo'

def first_difference(a, b, dtype):
    _, _, fmt, size = DTYPES[dtype]
    for i in range(0, min(len(a), len(b)), size):
        if a[i : i + size] != b[i : i + size]:
            x, y = struct.unpack("<" + fmt, a[i : i + size])[0], struct.unpack("<" + fmt, b[i : i + size])[0]
            if dtype == "bf16":
                x, y = x << 16, y << 16
            fx, fy = struct.unpack("<f", struct.pack("<I", x))[0], struct.unpack("<f", struct.pack("<I", y))[0]
            return i // size, fx, fy
    return None


def main():
    engine, replies = Engine(), []
    for i, req in enumerate(CALLS):
        rep = engine.handle(req)
        replies.append(rep)
        if not rep["ok"]:
            print(f"mlx-lm raised at call {i} ({req['op']}): {rep['error']}")
            sys.exit(1)
    if DIVERGENCE == "rows_vs_solo":
        # the batch read kvsim checked last, then each row's own serial cache fed the same request
        i = max(j for j, r in enumerate(CALLS) if r["op"] in ("rows_decode", "rows_window"))
        out = replies[i]["out"]
        rows, dtype = out["shape"][0], out["dtype"]
        raw = base64.b64decode(out["b64"])
        n = len(raw) // rows
        for r in range(rows):
            solo = base64.b64decode(replies[i + 1 + r]["out"]["b64"])
            d = first_difference(raw[r * n : (r + 1) * n], solo, dtype)
            if d is not None:
                print(f"call {i} ({CALLS[i]['op']}): row {r} differs from the same request run alone on its own serial "
                      f"cache (call {i + 1 + r}): element {d[0]} is {d[1]!r} in the batch, {d[2]!r} alone")
                sys.exit(1)
    if DIVERGENCE == "rows_trim_vs_solo":
        # the batch trim kvsim checked last, right after each row's own serial cache was trimmed alike
        i = len(CALLS) - 1
        j = i
        while j > 0 and CALLS[j - 1]["op"] == "trim":
            j -= 1
        alone = [replies[x]["trimmed"] for x in range(j, i)]
        if CALLS[i]["op"] == "rows_trim" and any(a != replies[i]["trimmed"] for a in alone):
            print(f"call {i} (rows_trim n={CALLS[i]['n']}): the batch trimmed {replies[i]['trimmed']}, "
                  f"its rows' own caches trimmed {alone} (calls {j}..{i - 1})")
            sys.exit(1)
    print("no divergence: mlx-lm behaves as kvsim expected on these calls")
    sys.exit(0)


main()
