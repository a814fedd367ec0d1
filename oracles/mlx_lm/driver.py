#!/usr/bin/env python3
"""kvsim's external oracle: replay kvsim oracle steps on mlx-lm's own KV caches.

    python driver.py STEPS.jsonl RESULTS.jsonl

Reads the steps (see ../PROTOCOL.md), executes each one on mlx-lm's caches (RotatingKVCache(max_size, keep=0) or
KVCache per request and layer; BatchRotatingKVCache / BatchKVCache for batches) on the MLX CPU device, and writes one
JSON line per read, trim, checkpoint, unsupported step and error. A one-line JSON summary goes to stdout.

The driver only *calls* mlx-lm (cache methods, trim_prompt_cache, base.create_attention_mask,
base.scaled_dot_product_attention); it re-implements none of it and works around none of its bugs. Two classes
mlx-lm 0.32.2 lacks are built from its pieces (../PROTOCOL.md decisions 15 and 16): RotatingQuantizedKVCache
(mlx-lm's RotatingKVCache over mx.quantize triples; only the array ops that must act on triples are redone) and
RowCaches (a quantized batch mapped onto each row's own solo caches). Only
`mlx_lm.models.base` and `mlx_lm.models.cache` are imported: the package's __init__ (transformers, huggingface_hub)
is bypassed, so mlx-lm can be installed with --no-deps.
"""
import base64
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import types
from importlib import metadata

import mlx.core as mx
import mlx.nn as nn

PINNED = {"mlx": "0.32.2", "mlx-lm": "0.32.2"}


# ----------------------------------------------------------------------------------------------------------------
# mlx-lm, imported without mlx_lm/__init__.py
# ----------------------------------------------------------------------------------------------------------------
def import_mlx_lm_models():
    """Register empty stand-ins for the packages `mlx_lm` and `mlx_lm.models` (pointing at the installed
    directories), so that `import mlx_lm.models.cache` runs only base.py and cache.py."""
    spec = importlib.util.find_spec("mlx_lm")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("driver.py: mlx_lm is not installed (run setup.sh and use .venv/bin/python)")
    root = next(iter(spec.submodule_search_locations))
    for name, path in (("mlx_lm", root), ("mlx_lm.models", os.path.join(root, "models"))):
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [path]
            stub.__package__ = name
            sys.modules[name] = stub
    sys.modules["mlx_lm"].models = sys.modules["mlx_lm.models"]
    return importlib.import_module("mlx_lm.models.base"), importlib.import_module("mlx_lm.models.cache")


BASE, CACHE = import_mlx_lm_models()
# the classes mlx-lm lacks, built from its pieces (imports mlx_lm.models.cache through the stand-ins above)
from lacking import RotatingQuantizedKVCache, RowCaches, relayout  # noqa: E402
# the recurrent family's ops (normalize_qk, compute_g, gated_delta_update and its ops path); imports only mlx
GATED = importlib.import_module("mlx_lm.models.gated_delta")

# ----------------------------------------------------------------------------------------------------------------
# arrays: protocol encoding in, sha256 of raw little-endian element bytes out
# ----------------------------------------------------------------------------------------------------------------
# protocol dtype -> (mlx dtype, same-width unsigned mlx dtype, memoryview format of that unsigned type, bytes)
DTYPES = {
    "f32": (mx.float32, mx.uint32, "I", 4),
    "bf16": (mx.bfloat16, mx.uint16, "H", 2),
}
BITS = {mx.float32: mx.uint32, mx.bfloat16: mx.uint16, mx.float16: mx.uint16, mx.uint32: mx.uint32}
EMPTY_SHA = hashlib.sha256(b"").hexdigest()


def decode_array(a):
    """`{"dtype", "shape", "b64"}` -> mx.array with exactly those element bits."""
    if a is None:
        raise ValueError("array missing")
    dt, udt, fmt, size = DTYPES[a["dtype"]]
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


# The bytes behind every read output's hash (PROTOCOL.md "Results": a read's record carries them as `vals`, so a
# divergence can be measured in ULPs, not only seen).
SEEN = {}


def sha(arr):
    """sha256 of the row-major raw element bytes (bf16 viewed as uint16, f32 as uint32)."""
    if arr.size == 0:
        return EMPTY_SHA
    raw = memoryview(mx.contiguous(arr.view(BITS[arr.dtype]))).tobytes()
    h = hashlib.sha256(raw).hexdigest()
    SEEN[h] = raw
    return h


def sha_many(arrs):
    """sha256 of the concatenated raw element bytes of several arrays (a quantized triple: packed, scales, biases)."""
    h = hashlib.sha256()
    for a in arrs:
        if a.size:
            h.update(memoryview(mx.contiguous(a.view(BITS.get(a.dtype, a.dtype)))).tobytes())
    return h.hexdigest()


def settle(caches):
    """Evaluate the cache arrays (as mlx-lm's generator does after every step) so graphs stay small."""
    arrs = []
    if isinstance(caches, RowCaches):
        caches = [c for row in caches.rows for c in row]
    for c in caches:
        if isinstance(c, CACHE.ArraysCache):  # the recurrent family: its slots and padding counters
            arrs.extend(x for x in (*c.cache, c.left_padding, c.lengths) if isinstance(x, mx.array))
            continue
        for name in ("keys", "values", "offset", "left_padding"):
            x = getattr(c, name, None)
            if isinstance(x, mx.array):
                arrs.append(x)
            elif isinstance(x, tuple):  # QuantizedKVCache: (packed, scales, biases)
                arrs.extend(a for a in x if isinstance(a, mx.array))
    if arrs:
        mx.eval(arrs)


class Unsupported(Exception):
    """The step has no faithful mlx-lm call."""


class DriverError(Exception):
    """The step does not fit the driver's state (unknown request, no batch, malformed step)."""


class _Hidden:
    """Stands in for the hidden states `h` that models pass to `create_attention_mask`; only `h.shape[1]`
    (the query length) is read there."""

    def __init__(self, B, L):
        self.shape = (B, L)


# ----------------------------------------------------------------------------------------------------------------
# the driver
# ----------------------------------------------------------------------------------------------------------------
class Driver:
    def __init__(self):
        self.cfg = None
        self.W = None  # window (max_size) or None for linear caches
        self.layers = 0
        self.scale = None
        self.solo = {}  # req -> [cache per layer] (RotatingKVCache / KVCache)
        self.running = None  # [batch cache per layer] or None
        self.rows = []  # req id of every running-batch row
        self.prefill = None  # [batch cache per layer] of the pending right-padded prefill batch
        self.prefill_rows = []
        self.lost = None  # why the running batch can no longer be trusted (set after a desyncing error)
        self.quant = None  # (bits, group) once the family's caches are affine-quantized (`quant` family)
        self.family = "attention"
        self.ssm = None  # `ssm` family: geometry dict and per-layer weights (see ssm_config)
        self.ssm_offsets = {}  # `ssm` family: req -> real positions consumed (driver bookkeeping; ArraysCache has none)
        # `ssm` family: the last batch layer calls since the last other step, per layer: mlx-lm's own slots before
        # the call, the call's inputs and each row's real span (what a rollback re-sync replays, decision 14)
        self.ssm_last = {}
        # attention family: every request's writes per layer, in order, as (k, v) [1, H, n, D] of its real positions
        # (the replay a wrapped ring's rollback re-syncs from, decision 14); trims pop positions from the end
        self.hist = {}
        self.last_kv = None

    # ---- helpers --------------------------------------------------------------------------------------------
    def new_cache(self):
        if self.family == "ssm":
            return CACHE.ArraysCache(size=2)  # qwen3_5.py / qwen3_next.py make_cache: a DeltaNet layer's cache
        if self.quant is not None:
            bits, group = self.quant
            if self.W is not None:
                # mlx-lm 0.32.2 has no rotating quantized cache: the driver's (decision 15)
                return RotatingQuantizedKVCache(self.W, 0, group_size=group, bits=bits)
            return CACHE.QuantizedKVCache(group_size=group, bits=bits)
        if self.W is None:
            return CACHE.KVCache()
        return CACHE.RotatingKVCache(max_size=self.W, keep=0)

    def quantized_rows(self):
        """Whether batches are mapped row by row (decision 16): the family's caches are quantized (mlx-lm 0.32.2
        has no batched quantized cache: generate._merge_caches refuses QuantizedKVCache, "does not yet support
        batching with history")."""
        return self.family == "quant" and self.quant is not None

    def to_quantized(self, c, group, bits):
        """One plain cache converted: `KVCache.to_quantized` (as generate.maybe_quantize_kv_cache), a ring by
        RotatingQuantizedKVCache.from_ring (decision 15); a cache already quantized stays as it is."""
        if isinstance(c, RotatingQuantizedKVCache) or not hasattr(c, "to_quantized"):
            return c
        if isinstance(c, CACHE.RotatingKVCache):
            return RotatingQuantizedKVCache.from_ring(c, group, bits)
        return c.to_quantized(group_size=group, bits=bits)

    def mask(self, cache, B, L):
        # exactly what a model's forward does: base.create_attention_mask(h, cache, window_size=...)
        return BASE.create_attention_mask(_Hidden(B, L), cache, window_size=self.W)

    def attend(self, cache, step, B):
        """A model layer's attention on `cache`: mask (from the cache state before the write, as a model computes
        it once before its layers run), update_and_fetch, then mlx-lm's SDPA helper. Returns the output or None."""
        read = step.get("read")
        if read not in ("decode", "window", "append"):
            raise DriverError(f"unknown read kind {read!r}")
        k, v = decode_array(step["k"]), decode_array(step["v"])
        q = None if read == "append" else decode_array(step.get("q"))
        return self.attend_kv(cache, read, k, v, q, B)

    def attend_kv(self, cache, read, k, v, q, B):
        if read == "append":
            cache.update_and_fetch(k, v)
            self.last_kv = (k, v)
            return None
        L = k.shape[2]
        mask = self.mask(cache, B, L)
        K, V = cache.update_and_fetch(k, v)
        self.last_kv = (k, v)
        # For a QuantizedKVCache (it has `bits`) this is base.quantized_scaled_dot_product_attention, which scales its
        # `queries` argument in place (`queries *= scale`): it gets a copy.
        return BASE.scaled_dot_product_attention(mx.array(q), K, V, cache=cache, scale=self.scale, mask=mask)

    def layer(self, step):
        l = int(step.get("layer", 0))
        if not 0 <= l < self.layers:
            raise DriverError(f"layer {l} out of range (layers = {self.layers})")
        return l

    def live(self, req):
        return req in self.solo or req in self.rows or req in self.prefill_rows

    def need_running(self):
        if self.running is None:
            raise DriverError("no running batch")
        if self.lost:
            raise DriverError(self.lost)
        return self.running

    def check_running(self, i):
        """After an exception inside mlx-lm: if the running batch no longer has one row per request the driver
        tracks (a join or filter stopped half-way across layers), say so for every later step that needs it."""
        if self.running is None or self.lost or isinstance(self.running, RowCaches):
            return
        try:
            sizes = [int(c.batch_size) if isinstance(c, CACHE.ArraysCache) else int(c.offset.shape[0])
                     for c in self.running]
        except Exception as e:  # noqa: BLE001
            sizes = [f"{type(e).__name__}"]
        if any(s != len(self.rows) for s in sizes):
            self.lost = (f"DriverStateLost: the error at step {i} left the running batch with per-layer row counts "
                         f"{sizes} for {len(self.rows)} requests")

    def row_shas(self, out, real):
        return [sha(out[r, :, : real[r], :]) for r in range(out.shape[0])]

    # ---- steps ----------------------------------------------------------------------------------------------
    def run_step(self, i, step):
        t = step.get("t")
        if t == "config":
            if self.cfg is not None:
                raise DriverError("a second config step")
            return self.s_config(step)
        if self.cfg is None:
            raise DriverError("no config step before this one")
        fn = getattr(self, "s_" + str(t), None)
        if fn is None or t == "config":
            raise DriverError(f"unknown step type {t!r}")
        if t not in ("batch", "round", "checkpoint"):
            self.ssm_last = {}
        return fn(i, step)

    def s_config(self, step):
        if step.get("dtype") not in DTYPES:
            raise DriverError(f"unsupported dtype {step.get('dtype')!r}")
        W = step.get("max_size")
        self.W = None if W is None else int(W)
        self.layers = int(step["layers"])
        self.scale = float(step.get("scale") or 0.0)
        if self.layers < 1 or (self.W is not None and self.W < 1):
            raise DriverError("layers and max_size must be >= 1")
        self.family = step.get("family", "attention")
        if self.family not in ("attention", "quant", "ssm"):
            raise DriverError(f"the driver maps the attention, quant and ssm families, not {step.get('family')!r}")
        if self.family == "ssm":
            self.ssm_config(step)
        q = step.get("quant")
        self.quant = None if q is None else (int(q["bits"]), int(q["group"]))
        self.cfg = step
        return None

    def s_admit(self, i, step):
        req = int(step["req"])
        if self.live(req):
            raise DriverError(f"request {req} is already live")
        self.solo[req] = [self.new_cache() for _ in range(self.layers)]
        self.ssm_offsets[req] = 0

    def s_solo(self, i, step):
        req = int(step["req"])
        if req not in self.solo:
            raise DriverError(f"request {req} has no solo cache")
        c = self.solo[req][self.layer(step)]
        if self.family == "ssm":
            y, spans = self.gdn(c, self.layer(step), step, 1)
            settle([c])
            if self.layer(step) == self.layers - 1:
                self.ssm_offsets[req] += spans[0][1] - spans[0][0]
            return {"rows": [sha(y[0, spans[0][0]: spans[0][1]])]}
        self.last_kv = None
        out = self.attend(c, step, 1)
        settle([c])
        self.hist_add(req, self.layer(step), *self.last_kv)
        if out is None:
            return None
        return {"rows": [sha(out[0])]}

    def s_solo_trim(self, i, step):
        req = int(step["req"])
        if req not in self.solo:
            raise DriverError(f"request {req} has no solo cache")
        # mlx-lm's trim entry point: refuses (returns 0, trims nothing) unless every layer is_trimmable()
        want = int(step["n"])
        n = CACHE.trim_prompt_cache(self.solo[req], want)
        settle(self.solo[req])
        self.hist_pop(req, n)
        if n == 0 and want > 0 and self.ring_wrapped(self.solo[req]) and self.undoes_window(step, [req], want):
            self.hist_pop(req, want)
            self.solo[req] = self.replay(req)
            return {"trimmed": 0, "resynced": want}
        return {"trimmed": int(n)}

    def s_enter(self, i, step):
        reqs = [int(r) for r in step["reqs"]]
        if step.get("how", "merge") not in ("merge", "join"):
            raise DriverError(f"unknown how {step.get('how')!r}")
        if not reqs or len(set(reqs)) != len(reqs) or any(r not in self.solo for r in reqs):
            raise DriverError(f"enter needs distinct requests with solo caches, got {reqs}")
        if self.running is not None and self.lost:
            raise DriverError(self.lost)
        if self.quantized_rows():
            # decision 16: the requests' own solo caches become rows (a merge lays each ring out as mlx-lm's does)
            if step.get("how", "merge") == "merge":
                for r in reqs:
                    for c in self.solo[r]:
                        relayout(c, "merge")
            new = RowCaches([self.solo[r] for r in reqs])
        else:
            # generate.py _merge_caches: caches[0][l].merge([c[l] for c in caches]); `join` is the same merge
            new = [self.solo[reqs[0]][l].merge([self.solo[r][l] for r in reqs]) for l in range(self.layers)]
        self.join_running(i, new, reqs)
        for r in reqs:
            del self.solo[r]
            self.hist_mark(r, step.get("how", "merge"))

    def join_running(self, i, new, reqs):
        # generate.py _extend_cache: the running batch extends itself with the new one (or is it, when none)
        if self.running is None:
            self.running, self.rows = new, list(reqs)
        elif isinstance(self.running, RowCaches) or isinstance(new, RowCaches):
            if not (isinstance(self.running, RowCaches) and isinstance(new, RowCaches)):
                raise DriverError("a quantized batch joins a plain one")
            self.running.rows.extend(new.rows)
            self.rows = self.rows + list(reqs)
            return
        else:
            try:
                for c, n in zip(self.running, new):
                    c.extend(n)
            except Exception:
                self.check_running(i)
                raise
            self.rows = self.rows + list(reqs)
        settle(self.running)

    def s_prefill(self, i, step):
        reqs = [int(r) for r in step["reqs"]]
        lengths = [int(x) for x in step["lengths"]]
        if self.prefill is not None:
            raise DriverError("a prefill batch is already pending")
        if not reqs or len(reqs) != len(lengths) or len(set(reqs)) != len(reqs):
            raise DriverError(f"prefill needs distinct requests with one length each, got {reqs} / {lengths}")
        if any(r in self.rows for r in reqs):
            raise DriverError(f"prefill requests {reqs} overlap the running batch")
        # fresh requests: their (empty) caches, the solo ones when admitted before, else new ones
        caches = [self.solo.get(r) or [self.new_cache() for _ in range(self.layers)] for r in reqs]
        if self.quantized_rows():
            # decision 16: each row its own caches; the right padding is no position of theirs
            self.prefill, self.prefill_rows = RowCaches(caches), reqs
            for r in reqs:
                self.solo.pop(r, None)
            return
        pb = [caches[0][l].merge([c[l] for c in caches]) for l in range(self.layers)]
        longest = max(lengths)
        padding = [longest - x for x in lengths]
        for c in pb:  # BatchGenerator.prompt(): prepare(lengths=, right_padding=)
            c.prepare(lengths=lengths, right_padding=padding)
        settle(pb)
        self.prefill, self.prefill_rows = pb, reqs
        for r in reqs:
            self.solo.pop(r, None)

    def s_prefill_chunk(self, i, step):
        if self.prefill is None:
            raise DriverError("no pending prefill batch")
        if isinstance(self.prefill, RowCaches):
            return self.rows_read(self.prefill, self.prefill_rows, step, [int(x) for x in step["real"]])
        c = self.prefill[self.layer(step)]
        B = len(self.prefill_rows)
        out = self.attend(c, dict(step, read=step.get("read", "window")), B)
        settle([c])
        k, v = self.last_kv
        for r, (req, n) in enumerate(zip(self.prefill_rows, [int(x) for x in step["real"]])):
            if n > 0:
                self.hist_add(req, self.layer(step), k[r: r + 1, :, :n], v[r: r + 1, :, :n])
        if out is None:
            return None
        real = [int(x) for x in step["real"]]
        if len(real) != out.shape[0]:
            raise DriverError(f"real has {len(real)} entries for {out.shape[0]} rows")
        return {"rows": self.row_shas(out, real)}

    def s_prefill_end(self, i, step):
        if self.prefill is None:
            raise DriverError("no pending prefill batch")
        if self.running is not None and self.lost:
            raise DriverError(self.lost)
        for c in ([] if isinstance(self.prefill, RowCaches) else self.prefill):
            c.finalize()
        pb, reqs = self.prefill, self.prefill_rows
        self.prefill, self.prefill_rows = None, []
        self.join_running(i, pb, reqs)

    def rows_read(self, batch, reqs, step, real):
        """A batch write (+ read) on rows mapped one by one (decision 16): row r's caches of the step's layer get
        the row's first real[r] positions alone (a row with none: nothing is called), read with its own mask (from
        its own cache, before the write) and its real queries; the outputs are stacked (zeros past each row's real
        queries) and hashed as a batch's rows."""
        l = self.layer(step)
        read = step.get("read", "window")
        k, v = decode_array(step["k"]), decode_array(step["v"])
        q = None if read == "append" else decode_array(step.get("q"))
        if len(real) != len(reqs) or k.shape[0] != len(reqs):
            raise DriverError(f"{k.shape[0]} rows / {len(real)} real counts for {len(reqs)} rows")
        L = k.shape[2]
        outs, failed = [], {}
        for r, (req, n) in enumerate(zip(reqs, real)):
            c = batch.rows[r][l]
            out = None
            if n > 0:
                kr, vr = k[r: r + 1, :, :n], v[r: r + 1, :, :n]
                try:
                    out = self.attend_kv(c, read, kr, vr, None if q is None else q[r: r + 1, :, :n], 1)
                    settle([c])
                except Exception as e:  # noqa: BLE001 -- one row's own cache failed (e.g. quant-packed-width)
                    failed[r] = f"error: {type(e).__name__}: {e}"
                self.hist_add(req, l, kr, vr)
            if q is not None:
                if out is None:
                    out = mx.zeros((1, q.shape[1], 0, q.shape[3]), dtype=q.dtype)
                if out.shape[2] < L:
                    out = mx.concatenate([out, mx.zeros((1, q.shape[1], L - out.shape[2], q.shape[3]), out.dtype)], 2)
                outs.append(out)
        if q is None:
            return None  # an append has no record; a row whose cache raised shows at the next checkpoint
        rows = self.row_shas(mx.concatenate(outs, axis=0), real)
        for r, e in failed.items():
            rows[r] = e  # the row's own solo cache raised: no output (the other rows are independent)
        return {"rows": rows}

    def s_batch(self, i, step):
        running = self.need_running()
        if isinstance(running, RowCaches):
            return self.rows_read(running, self.rows, step, [decode_array(step["k"]).shape[2]] * len(self.rows))
        c = running[self.layer(step)]
        if self.family == "ssm":
            l = self.layer(step)
            if l == 0:
                self.ssm_last = {}
            pre = list(c.cache)
            arrays = (decode_array(step["qkv"]), decode_array(step["a"]), decode_array(step["b"]))
            y, spans = self.gdn(c, l, step, len(self.rows), arrays)
            settle([c])
            self.ssm_last[l] = {"pre": pre, "arrays": arrays, "spans": spans, "rows": list(self.rows)}
            if self.layer(step) == self.layers - 1:
                for req, (s0, s1) in zip(self.rows, spans):
                    self.ssm_offsets[req] = self.ssm_offsets.get(req, 0) + s1 - s0
            return {"rows": [sha(y[r, s0:s1]) for r, (s0, s1) in enumerate(spans)]}
        out = self.attend(c, step, len(self.rows))
        settle([c])
        k, v = self.last_kv
        for r, req in enumerate(self.rows):
            self.hist_add(req, self.layer(step), k[r: r + 1], v[r: r + 1])
        if out is None:
            return None
        L = out.shape[2]
        res = {"rows": self.row_shas(out, [L] * out.shape[0])}
        if self.family == "attention" and self.quant is None:
            q = decode_array(step.get("q"))
            res["solo"] = [self.solo_read(req, self.layer(step), k[r: r + 1], v[r: r + 1], q[r: r + 1])
                           for r, req in enumerate(self.rows)]
        return res

    def solo_read(self, req, l, k, v, q):
        """mlx-lm's own solo computation of one batch row (PROTOCOL.md decision 17): a fresh cache of the request's
        class replays the request's earlier writes of this layer (its history, as the re-syncs of decision 14), then
        this step's write and read as a solo request would make them. The sha256 of its output (None without a
        history): the reference a batch row's divergence is judged against."""
        writes = self.hist.get(req)
        if not writes or not writes[l]:
            return None
        c = self.new_cache()
        for kk, vv in writes[l][:-1]:
            c.update_and_fetch(kk, vv)
        mask = self.mask(c, 1, k.shape[2])
        K, V = c.update_and_fetch(k, v)
        out = BASE.scaled_dot_product_attention(mx.array(q), K, V, cache=c, scale=self.scale, mask=mask)
        return sha(out[0])

    def rows_trim(self, step, ns):
        """Trims of rows mapped one by one (decision 16): each row's own `trim_prompt_cache` (a per-row rollback is
        a solo trim there); a row refused on a wrapped ring is re-synced by replay as a solo request (decision 14).
        Result as for a batch: `trimmed` (plus `resynced`) when every row asked the same n and got the same answer,
        else `trimmed_rows`, what each row dropped."""
        got, replayed = [], []
        for r, (req, n) in enumerate(zip(self.rows, ns)):
            caches = self.running.rows[r]
            g = CACHE.trim_prompt_cache(caches, n) if n > 0 else 0
            settle(caches)
            self.hist_pop(req, g)
            if g == 0 and n > 0 and self.ring_wrapped(caches) and self.undoes_window(step, [req], n):
                self.hist_pop(req, n)
                self.running.rows[r] = self.replay(req)
                replayed.append(r)
                g = n
            got.append(g)
        if len(set(ns)) == 1 and len(set(got)) == 1:
            if replayed:
                return {"trimmed": 0, "resynced": ns[0]} if len(replayed) == len(ns) else {"trimmed": got[0]}
            return {"trimmed": got[0]}
        return {"trimmed_rows": got}

    def s_trim(self, i, step):
        running = self.need_running()
        want = int(step["n"])
        if isinstance(running, RowCaches):
            return self.rows_trim(step, [want] * len(self.rows))
        n = CACHE.trim_prompt_cache(running, want)
        settle(running)
        return self.batch_trimmed(step, n, want)

    def batch_trimmed(self, step, n, want):
        for req in self.rows:
            self.hist_pop(req, n)
        if n == 0 and want > 0 and self.ring_wrapped(self.running) and self.undoes_window(step, self.rows, want):
            self.running = self.replay_batch(want)
            return {"trimmed": 0, "resynced": want}
        return {"trimmed": int(n)}

    # ---- the replay re-sync of a wrapped ring's rollback (decision 14) ----------------------------------------
    def hist_add(self, req, l, k, v):
        if self.family == "ssm":
            return
        self.hist.setdefault(req, [[] for _ in range(self.layers)])[l].append((k, v))

    def hist_mark(self, req, how):
        """The quantized family: a layout event (`merge`, `extract`) of req's row in its history, so that a replay
        of a row at a conversion (s_quantize) lays the ring out as kvsim's row is laid out (decision 16)."""
        if self.family == "quant" and how in ("merge", "extract"):
            for layer in self.hist.setdefault(req, [[] for _ in range(self.layers)]):
                layer.append(how)

    def hist_pop(self, req, n):
        """Drops the newest n positions of req's history (every layer)."""
        for layer in self.hist.get(req, []):
            left = n
            marks = []
            while left > 0 and layer:
                if isinstance(layer[-1], str):
                    marks.append(layer.pop())
                    continue
                k, v = layer.pop()
                m = k.shape[2]
                if m > left:
                    layer.append((k[:, :, : m - left], v[:, :, : m - left]))
                left -= min(m, left)
            layer.extend(reversed(marks))

    def undoes_window(self, step, reqs, n):
        """A speculative rollback (`bypass`) of fewer positions than the requests' last write added, in every layer:
        a ring's concat write of L positions keeps its newest max_size - 1 positions before appending, so its
        buffer still holds every position a rollback of n < L needs (the newest max_size of what stays); for
        n = L the oldest of them was dropped by that write, and no replay is made."""
        return bool(step.get("bypass")) and all(
            req in self.hist and all(layer and not isinstance(layer[-1], str) and layer[-1][0].shape[2] > n
                                     for layer in self.hist[req]) for req in reqs)

    def ring_wrapped(self, caches):
        """mlx-lm's own reason for the refusal (bug-catalog #18): a rotating cache that is no longer trimmable.
        Only then does the driver replay."""
        return self.family != "ssm" and self.W is not None and any(not c.is_trimmable() for c in caches)

    def replay(self, req):
        """req's caches rebuilt by mlx-lm from its history: fresh caches, one update_and_fetch per recorded write."""
        caches = [self.new_cache() for _ in range(self.layers)]
        for c, writes in zip(caches, self.hist.get(req, [[] for _ in range(self.layers)])):
            for w in writes:
                if isinstance(w, str):
                    relayout(c, w)  # a layout event of the quantized family's rows (hist_mark)
                else:
                    c.update_and_fetch(*w)
        settle(caches)
        return caches

    def replay_batch(self, want):
        """The running batch rebuilt: every row's request replayed (above), then merged in row order (as enter)."""
        for req in self.rows:
            self.hist_pop(req, want)
        rows = [self.replay(req) for req in self.rows]
        new = [rows[0][l].merge([rc[l] for rc in rows]) for l in range(self.layers)]
        settle(new)
        return new

    def s_trim_rows(self, i, step):
        running = self.need_running()
        ns = [int(x) for x in step["n"]]
        if len(ns) != len(self.rows):
            raise DriverError(f"trim_rows has {len(ns)} counts for {len(self.rows)} rows")
        if isinstance(running, RowCaches):
            return self.rows_trim(step, ns)
        if len(set(ns)) != 1:
            return self.trim_rows_resync(step, ns)
        n = CACHE.trim_prompt_cache(running, ns[0])
        settle(running)
        return self.batch_trimmed(step, n, ns[0])

    def trim_rows_resync(self, step, ns):
        """Unequal per-row counts: mlx-lm's batch caches trim every row by one n. Re-sync (decision 14): every row
        is taken out with mlx-lm's `extract(row)`, each row that drops positions is trimmed by mlx-lm's own
        `trim_prompt_cache` on those caches, and the batch is rebuilt by `merge` of the rows in order (as
        `generate._merge_caches`). A row whose trim `trim_prompt_cache` refuses on a wrapped ring (bug-catalog #18)
        is rebuilt by replay instead, under the conditions of the uniform case (`undoes_window`). Result
        `trimmed_rows`: what each row dropped. When a row can be neither trimmed nor replayed, or the batch holds no
        arrays, nothing changes and the step is unsupported as before."""
        why = f"per-row trim counts {ns}: mlx-lm batch caches trim every row by the same n"
        running = self.running
        if self.family == "ssm" or any(c.keys is None for c in running):
            raise Unsupported(why)
        rows = [[c.extract(r) for c in running] for r in range(len(self.rows))]
        replay = []
        for r, n in enumerate(ns):
            if n > 0:
                got = CACHE.trim_prompt_cache(rows[r], n)
                if got == 0 and self.ring_wrapped(rows[r]) and self.undoes_window(step, [self.rows[r]], n):
                    replay.append(r)
                elif got != n:
                    raise Unsupported(why + f" (row {r}: trim_prompt_cache trimmed {got} of {n}, no re-sync)")
        for req, n in zip(self.rows, ns):
            self.hist_pop(req, n)
        for r in replay:
            rows[r] = self.replay(self.rows[r])
        self.running = [rows[0][l].merge([rc[l] for rc in rows]) for l in range(self.layers)]
        settle(self.running)
        return {"trimmed_rows": ns}

    def s_extract(self, i, step):
        running = self.need_running()
        row = int(step["row"])
        if not 0 <= row < len(self.rows):
            raise DriverError(f"row {row} out of range ({len(self.rows)} rows)")
        req = self.rows[row]
        resync = None
        try:
            if isinstance(running, RowCaches):
                exts = running.rows[row]
                for c in exts:
                    relayout(c, "extract")
            else:
                exts = [c.extract(row) for c in running]
            self.hist_mark(req, "extract")
        except TypeError as e:
            # mlx-lm's extract indexes the batch's arrays without checking that it has any (the rule
            # extract-empty-batch). Re-sync (decision 14): when mlx-lm's own batch holds no arrays in any layer and
            # the row's offset is 0, the row holds nothing in mlx-lm, and its solo cache is a fresh one.
            if not (self.empty_batch(running, row) and self.quant is None):
                raise
            exts = [self.new_cache() for _ in range(self.layers)]
            resync = f"{type(e).__name__}: {e} [driver re-synced: the row holds nothing, its solo cache is a new one]"
        others = [r for r in range(len(self.rows)) if r != row]
        offset = self.ssm_offsets.get(req, 0)
        self.filter_running(i, others)
        if not step.get("finish", False):
            self.solo[req] = exts
            self.ssm_offsets[req] = offset
            settle(exts)
        if resync is not None:
            return {"error": resync}

    def empty_batch(self, running, row):
        """Whether mlx-lm's batch holds no arrays in any layer and the row's offset is 0 (mlx-lm's own state)."""
        if self.family == "ssm":
            return all(x is None for c in running for x in c.cache) and self.ssm_offsets.get(self.rows[row], 0) == 0
        return all(c.keys is None for c in running) and int(running[0].offset.tolist()[row]) == 0

    def s_filter(self, i, step):
        self.need_running()
        keep = [int(r) for r in step["keep"]]
        if any(not 0 <= r < len(self.rows) for r in keep):
            raise DriverError(f"keep {keep} out of range ({len(self.rows)} rows)")
        self.filter_running(i, keep)

    def filter_running(self, i, keep):
        # generate.py Batch.filter(): an empty keep clears the batch's cache list, else c.filter(keep) per layer
        if not keep:
            for r in self.rows:
                if r not in self.solo:
                    self.ssm_offsets.pop(r, None)
            self.running, self.rows = None, []
            return
        try:
            if isinstance(self.running, RowCaches):
                self.running.rows = [self.running.rows[r] for r in keep]
            else:
                for c in self.running:
                    c.filter(keep)
        except Exception:
            self.check_running(i)
            raise
        for r in range(len(self.rows)):
            if r not in keep and self.rows[r] not in self.solo:
                self.ssm_offsets.pop(self.rows[r], None)
        self.rows = [self.rows[r] for r in keep]
        settle(self.running)

    def s_quantize(self, i, step):
        """The conversion op, as mlx-lm's generate.maybe_quantize_kv_cache does it: `c.to_quantized(group_size, bits)`
        for every cache that has the method (a QuantizedKVCache has none and stays as it is), a plain ring through
        RotatingQuantizedKVCache.from_ring (decision 15: mlx-lm's own RotatingKVCache.to_quantized raises
        NotImplementedError). A running batch (decision 16) is converted row by row: each row's solo form, converted
        as a solo cache, becomes a row of the row-by-row batch: a linear row as mlx-lm's `extract(row)` gives it (its
        columns are the row's, in order), a ring as the request's own solo ring rebuilt by replay of its writes
        (decision 14's `replay`: mlx-lm's batch ring keeps another physical layout than the row's own solo ring,
        which is what kvsim's row keeps and converts as laid out); a batch that holds no arrays: new caches. All
        caches are converted into new objects first and replace the old ones only when every call succeeded (mlx-lm
        raises from mx.quantize on parameters it refuses). Later admits get QuantizedKVCache(group, bits) /
        RotatingQuantizedKVCache. A pending prefill is unsupported (kvsim converts none mid-prefill). Result:
        {"converted": true} when the driver's caches changed storage."""
        bits, group = int(step["bits"]), int(step["group"])
        if self.quant is not None:
            return {"converted": False}
        if self.prefill is not None:
            raise Unsupported("mlx-lm 0.32.2 has no batched quantized cache and the driver maps no conversion of a "
                              "pending prefill batch (BatchKVCache has no to_quantized, "
                              "BatchRotatingKVCache.to_quantized raises NotImplementedError)")
        running = self.need_running() if self.running is not None else None
        new = {}
        for req, caches in self.solo.items():
            new[req] = [self.to_quantized(c, group, bits) for c in caches]
        rows = None
        if running is not None:
            rows = []
            for r, req in enumerate(self.rows):
                if all(c.keys is None for c in running):
                    plain = [self.new_cache() for _ in range(self.layers)]
                elif self.W is None:
                    plain = [c.extract(r) for c in running]
                else:
                    plain = self.replay(req)
                rows.append([self.to_quantized(c, group, bits) for c in plain])
        for req, caches in new.items():
            self.solo[req] = caches
            settle(caches)
        if rows is not None:
            self.running = RowCaches(rows)
            settle(self.running)
        self.quant = (bits, group)
        return {"converted": True}

    def s_checkpoint(self, i, step):
        if self.family == "ssm":
            return self.ssm_checkpoint(step)
        reqs = {}
        for req, caches in self.solo.items():
            reqs[req] = self.solo_view(caches)
        for batch, rows in ((self.running, self.rows), (self.prefill, self.prefill_rows)):
            if batch is None:
                continue
            if batch is self.running and self.lost:
                raise DriverError(self.lost)
            for row, req in enumerate(rows):
                if isinstance(batch, RowCaches):
                    reqs[req] = self.solo_view(batch.rows[row])
                else:
                    reqs[req] = self.batch_view(batch, row, req)
        return {"op": step.get("op"), "reqs": {str(r): reqs[r] for r in sorted(reqs)}}

    def window_tail(self, x, offset):
        """The newest min(offset, W) columns of a [1, H, n, D] buffer already in temporal order, as [H, n, D]."""
        n = offset if self.W is None else min(offset, self.W)
        n = max(0, min(n, x.shape[2]))
        return x[0, :, x.shape[2] - n:, :]

    def solo_view(self, caches):
        offset = int(caches[0].offset)
        ks, vs = [], []
        for c in caches:
            if c.keys is None:
                ks.append(EMPTY_SHA)
                vs.append(EMPTY_SHA)
                continue
            if isinstance(c, CACHE.QuantizedKVCache):
                # the (packed, scales, biases) triples of the first `offset` positions, hashed together
                n = max(0, min(c.offset, c.keys[0].shape[2]))
                ks.append(sha_many([x[0, :, :n, :] for x in c.keys]))
                vs.append(sha_many([x[0, :, :n, :] for x in c.values]))
                continue
            if isinstance(c, RotatingQuantizedKVCache):
                # the triples of the newest min(offset, W) positions in temporal order (`_temporal_order` per plane)
                k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
                ks.append(sha_many([self.window_tail(x, c.offset) for x in k]))
                vs.append(sha_many([self.window_tail(x, c.offset) for x in v]))
                continue
            if isinstance(c, CACHE.RotatingKVCache):
                k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
            else:
                k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            ks.append(sha(self.window_tail(k, c.offset)))
            vs.append(sha(self.window_tail(v, c.offset)))
        return {"offset": offset, "k": ks, "v": vs}

    def batch_view(self, batch, row, req):
        offset = int(batch[0].offset.tolist()[row])
        ks, vs = [], []
        for c in batch:
            if c.keys is None:
                ks.append(EMPTY_SHA)
                vs.append(EMPTY_SHA)
                continue
            # mlx-lm's own de-rolled, padding-free view of the row (extract does not modify the batch)
            try:
                e = c.extract(row)
            except Exception as ex:
                raise RuntimeError(f"extract({row}) for request {req}: {type(ex).__name__}: {ex}") from ex
            ks.append(sha(self.window_tail(e.keys, offset)))
            vs.append(sha(self.window_tail(e.values, offset)))
        return {"offset": offset, "k": ks, "v": vs}


    # ---- the recurrent family (`family: "ssm"`) -----------------------------------------------------------------
    def ssm_config(self, step):
        g = step.get("ssm") or {}
        try:
            dims = {k: int(g[k]) for k in ("kernel", "heads_k", "heads_v", "dk", "dv")}
        except (KeyError, TypeError, ValueError) as e:
            raise DriverError(f"ssm config needs kernel, heads_k, heads_v, dk, dv: {e}") from e
        if min(dims.values()) < 1 or dims["heads_v"] % dims["heads_k"]:
            raise DriverError(f"bad ssm geometry {dims}")
        dims["conv_dim"] = 2 * dims["heads_k"] * dims["dk"] + dims["heads_v"] * dims["dv"]
        weights = step.get("weights") or []
        if len(weights) != int(step["layers"]):
            raise DriverError(f"ssm config has {len(weights)} weight sets for {step['layers']} layers")
        layers = []
        for w in weights:
            cw = decode_array(w["conv_weight"])
            if tuple(cw.shape) != (dims["conv_dim"], dims["kernel"], 1):
                raise DriverError(f"conv_weight shape {cw.shape}, expected {(dims['conv_dim'], dims['kernel'], 1)}")
            # qwen3_5.py GatedDeltaNet: nn.Conv1d(conv_dim, conv_dim, bias=False, kernel_size=K, groups=conv_dim,
            # padding=0); its weight after sanitize is [conv_dim, K, 1]
            conv = nn.Conv1d(dims["conv_dim"], dims["conv_dim"], kernel_size=dims["kernel"], padding=0,
                             groups=dims["conv_dim"], bias=False)
            conv.weight = cw
            layers.append({"conv1d": conv, "A_log": decode_array(w["a_log"]), "dt_bias": decode_array(w["dt_bias"])})
        self.ssm = {"dims": dims, "layers": layers}

    def gdn(self, cache, l, step, B, arrays=None):
        """The cache-side part of mlx-lm 0.32.2's gated-DeltaNet layer (qwen3_5.py GatedDeltaNet.__call__, the same
        in qwen3_next.py), from its projections on: the mask from the cache (base.create_ssm_mask = make_mask(S)),
        padded qkv zeroed, conv over concat(conv_state, qkv), the conv state (take_along_axis at lengths, or the last
        K-1 rows), silu, split, normalize_qk, gated_delta_update (the ops path on CPU), both slots written,
        advance(S). Returns y [B, S, Hv, Dv] (before the gated norm and out_proj) and each row's real [start, end)."""
        d = self.ssm["dims"]
        w = self.ssm["layers"][l]
        if arrays is None:
            arrays = (decode_array(step["qkv"]), decode_array(step["a"]), decode_array(step["b"]))
        qkv, a, b = arrays
        S = qkv.shape[1]
        if qkv.shape[0] != B or qkv.shape[2] != d["conv_dim"]:
            raise DriverError(f"qkv shape {qkv.shape} for {B} rows, conv_dim {d['conv_dim']}")
        mask = BASE.create_ssm_mask(_Hidden(B, S), cache)
        spans = [(0, S)] * B
        if mask is not None:
            m = mask.tolist()
            spans = []
            for row in m:
                idx = [t for t, x in enumerate(row) if x]
                spans.append((idx[0], idx[-1] + 1) if idx else (0, 0))
        conv_state = cache[0] if cache[0] is not None else mx.zeros((B, d["kernel"] - 1, d["conv_dim"]),
                                                                     dtype=qkv.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        n_keep = d["kernel"] - 1
        if cache.lengths is not None:
            ends = mx.clip(cache.lengths, 0, S)
            positions = (ends[:, None] + mx.arange(n_keep))[..., None]
            cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
        else:
            cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
        conv_out = nn.silu(w["conv1d"](conv_input))
        kd = d["heads_k"] * d["dk"]
        q, k, v = [
            t.reshape(B, S, h, e)
            for t, h, e in zip(mx.split(conv_out, [kd, 2 * kd], -1), [d["heads_k"], d["heads_k"], d["heads_v"]],
                               [d["dk"], d["dk"], d["dv"]])
        ]
        state = cache[1]
        q, k = GATED.normalize_qk(q, k, inv_scale=d["dk"] ** -0.5, eps=1e-6)
        out, state = GATED.gated_delta_update(q, k, v, a, b, w["A_log"], w["dt_bias"], state, mask, use_kernel=True)
        cache[1] = state
        cache.advance(S)
        return out, spans

    def s_prepare(self, i, step):
        """The recurrent family's prepared prefill over the running batch: `left_padding` set as
        generate._make_cache's ArraysCache(size, left_padding) constructor sets it (ArraysCache has no other entry
        for it), then `prepare(lengths=)`."""
        if self.family != "ssm":
            raise DriverError("prepare is a step of the ssm family")
        running = self.need_running()
        lengths = [int(x) for x in step["lengths"]]
        left = [int(x) for x in (step.get("left") or [])]
        if len(lengths) != len(self.rows) or (left and len(left) != len(self.rows)):
            raise DriverError(f"prepare has {len(lengths)} lengths / {len(left)} lefts for {len(self.rows)} rows")
        for c in running:
            if left and any(left):
                c.left_padding = mx.array(left)
            c.prepare(lengths=lengths)
        settle(running)

    def s_finalize(self, i, step):
        running = self.need_running()
        for c in running:
            c.finalize()
        settle(running)

    def s_round(self, i, step):
        """A resolved speculative round. A commit (every row keeps `gamma`) is the round's window call alone, which
        mlx-lm made: nothing more to call, no record. A rollback has no mlx-lm counterpart (ArraysCache cannot be
        trimmed); the driver re-syncs by replay (decision 14): each row that keeps fewer than `gamma` positions gets,
        in every layer, mlx-lm's own slots from before the window call, advanced by mlx-lm's layer arithmetic over
        the row's first `keep` inputs of that call (nothing of kvsim's state is used). Result: `trimmed_rows`, what
        each row dropped. When the window calls are not there to replay (another step came between, a padded span,
        other rows), the rollback is unsupported as before."""
        keep, gamma = step.get("keep"), step.get("gamma")
        if keep is not None and gamma is not None and all(int(k) == int(gamma) for k in keep):
            return None
        why = ("mlx-lm 0.32.2 has no speculative round for ArraysCache: is_trimmable() is False and "
               "generate.speculative_generate_step refuses caches that cannot be trimmed")
        if keep is None or gamma is None:
            raise Unsupported(why + " (no keep to replay)")
        running = self.need_running()
        gamma, keep = int(gamma), [int(k) for k in keep]
        if len(keep) != len(self.rows) or any(not 0 <= k <= gamma for k in keep):
            raise DriverError(f"round keep {keep} for {len(self.rows)} rows, gamma {gamma}")
        replayable = sorted(self.ssm_last) == list(range(self.layers)) and all(
            x["rows"] == self.rows and x["spans"] == [(0, gamma)] * len(self.rows) for x in self.ssm_last.values())
        if not replayable:
            raise Unsupported(why + " (no window call of the round to replay)")
        for l, c in enumerate(running):
            last = self.ssm_last[l]
            qkv, a, b = last["arrays"]
            for r, k in enumerate(keep):
                if k == gamma:
                    continue
                # the row's own slots before the window, as mlx-lm's extract gives them (a slot still empty is
                # None: the zero state, as ArraysCache.extend / GatedDeltaNet start from)
                solo = CACHE.ArraysCache(size=2)
                solo.cache = [x[r: r + 1] if x is not None else None for x in last["pre"]]
                if k > 0:
                    self.gdn(solo, l, None, 1, (qkv[r: r + 1, :k], a[r: r + 1, :k], b[r: r + 1, :k]))
                for slot in range(len(c.cache)):
                    cur, new = c.cache[slot], solo.cache[slot]
                    if new is None:
                        new = mx.zeros((1,) + tuple(cur.shape[1:]), dtype=cur.dtype)
                    c.cache[slot] = mx.concatenate([cur[:r], new, cur[r + 1:]])
            settle([c])
        for r, k in enumerate(keep):
            req = self.rows[r]
            self.ssm_offsets[req] = self.ssm_offsets.get(req, 0) - (gamma - k)
        self.ssm_last = {}
        return {"trimmed_rows": [gamma - k for k in keep]}

    def ssm_checkpoint(self, step):
        d = self.ssm["dims"]
        reqs = {}

        def view(caches, row):
            conv, rec = [], []
            for c in caches:
                # a batch row's slots through mlx-lm's own extract (it does not modify the batch); a batch whose
                # slots are still empty has nothing to extract (ArraysCache.extract would index None)
                e = c.extract(row) if row is not None and c[0] is not None else c
                # a slot mlx-lm has not filled yet is the zero state (ArraysCache.merge / extend zero-fill it and
                # GatedDeltaNet starts from zeros)
                cs = e[0] if e[0] is not None else mx.zeros((1, d["kernel"] - 1, d["conv_dim"]),
                                                            dtype=DTYPES[self.cfg["dtype"]][0])
                rs = e[1] if e[1] is not None else mx.zeros((1, d["heads_v"], d["dv"], d["dk"]), dtype=mx.float32)
                conv.append(sha(cs[0]))
                rec.append(sha(rs[0]))
            return conv, rec

        for req, caches in self.solo.items():
            reqs[req] = (caches, None)
        if self.running is not None:
            if self.lost:
                raise DriverError(self.lost)
            for row, req in enumerate(self.rows):
                reqs[req] = (self.running, row)
        out = {}
        for req in sorted(reqs):
            conv, rec = view(*reqs[req])
            out[str(req)] = {"offset": self.ssm_offsets.get(req, 0), "conv": conv, "rec": rec}
        return {"op": step.get("op"), "reqs": out}


# ----------------------------------------------------------------------------------------------------------------
def versions():
    return {"mlx": mx.__version__, "mlx_lm": metadata.version("mlx-lm")}


def main(argv):
    if len(argv) != 3:
        print("usage: driver.py STEPS.jsonl RESULTS.jsonl", file=sys.stderr)
        return 2
    if sys.byteorder != "little":
        print("driver.py: needs a little-endian host", file=sys.stderr)
        return 2
    have = versions()
    if (have["mlx"], have["mlx_lm"]) != (PINNED["mlx"], PINNED["mlx-lm"]) and not os.environ.get(
        "KVSIM_ORACLE_ANY_VERSION"
    ):
        print(f"driver.py: pinned to mlx {PINNED['mlx']} / mlx-lm {PINNED['mlx-lm']}, found {have} "
              "(run setup.sh; KVSIM_ORACLE_ANY_VERSION=1 to run anyway)", file=sys.stderr)
        return 2
    mx.set_default_device(mx.cpu)

    drv = Driver()
    counts = {"steps": 0, "reads": 0, "unsupported": 0, "errors": 0}
    with open(argv[1], encoding="utf-8") as fin, open(argv[2], "w", encoding="utf-8") as fout:
        for i, line in enumerate(fin):
            if not line.strip():
                continue  # blank lines carry no step but keep their line number
            counts["steps"] += 1
            rec = None
            SEEN.clear()
            try:
                step = json.loads(line)
                if not isinstance(step, dict):
                    raise DriverError("a step must be a JSON object")
                res = drv.run_step(i, step)
                if res is not None:
                    rec = {"step": i, **res}
                    if "rows" in res:
                        counts["reads"] += 1
                        rec["vals"] = [base64.b64encode(SEEN[h]).decode("ascii") if h in SEEN else None for h in res["rows"]]
                    if "error" in res:
                        counts["errors"] += 1
            except Unsupported as e:
                rec = {"step": i, "unsupported": str(e)}
                counts["unsupported"] += 1
            except Exception as e:  # noqa: BLE001 -- every failure is data for the comparison
                rec = {"step": i, "error": f"{type(e).__name__}: {e}"}
                counts["errors"] += 1
            if rec is not None:
                fout.write(json.dumps(rec, separators=(",", ":")) + "\n")
    print(json.dumps({**counts, **versions()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
