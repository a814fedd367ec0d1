#!/usr/bin/env python3
"""Self-test of the mlx-lm oracle driver.

    .venv/bin/python selftest.py            # run the checks
    .venv/bin/python selftest.py --write    # regenerate the steps files after editing a scenario

Short hand-written scenarios:
- selftest_steps.jsonl (W = 4, f32): two requests written solo past the window (one by decodes, one by a 6-token
  window read), a trim before and after the wrap, a merge into a batch, batch decodes / append / window read,
  per-row and uniform trims, an extract, a right-padded batch prefill, a join and a filter;
- selftest_linear_steps.jsonl (no window, bf16): solo window/decode reads, a trim and rewrite, a left-padded merge,
  a batch trim, a finishing extract and a two-chunk right-padded prefill (one chunk all padding for a row);
- selftest_quant*_steps.jsonl (the quantized family, D = 64 / 128): conversion of plain solo caches
  (KVCache.to_quantized), refused bits, quantized reads and views, a fresh QuantizedKVCache and its trim, the
  unsupported batch entry; the 5-bit packed-width crash at D = 128; RotatingKVCache.to_quantized's
  NotImplementedError; a native rotating quantized cache (unsupported);
- selftest_ssm_steps.jsonl (the recurrent family, f32): ArraysCache with the gated-DeltaNet layer arithmetic through
  solo calls, merge, a join of a fresh request, right- and left-padded prepares, finalize, extract, a reordering filter
  and a round (unsupported); outputs and recurrent states checked against a direct computation from MLX ops (no
  mlx-lm), conv states against the last K-1 inputs from the floats.
The steps are written with the protocol's array encoding (the files are committed; the test fails when one is stale),
the driver runs them in a subprocess, and the results are checked against facts computed here independently of it:
K/V view hashes straight from the input floats (struct + hashlib, no MLX), attention outputs from a direct
mx.fast.scaled_dot_product_attention call with hand-ordered keys and a hand-built mask (no mlx-lm), trim counts,
and the summary line. Quantized views are checked against mx.quantize of the floats, quantized reads against a
quantized attention written here from MLX's ops (mx.quantize, mx.quantized_matmul, mx.softmax; no mlx-lm).
"""
import base64
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
HKV, HQ, D, SCALE = 2, 4, 8, 0.25


class Data:
    """Every (request, position) has its own q / k / v vectors, multiples of 1/16 in [-2, 2] (exact in f32 and bf16).
    A position >= 100 names a token written after a rollback (a different token at a reused position)."""

    def __init__(self, seed, W, dtype, dim=D, quant=None):
        self.rng, self.W, self.dtype, self.tok_ = random.Random(seed), W, dtype, {}
        self.d, self.quant = dim, quant  # head dim; initial (bits, group) of a quantized-family config

    def tok(self, req, pos):
        if (req, pos) not in self.tok_:
            def vec(h):
                return [[self.rng.randint(-32, 32) / 16 for _ in range(self.d)] for _ in range(h)]

            self.tok_[(req, pos)] = {"q": vec(HQ), "k": vec(HKV), "v": vec(HKV)}
        return self.tok_[(req, pos)]

    def block(self, field, rows):
        """[B][H][L][D] nested list; rows = [[(req, pos) or None (padding: zeros), ...] per batch row]."""
        H = HQ if field == "q" else HKV
        return [[[self.tok(*rp)[field][h] if rp else [0.0] * self.d for rp in row] for h in range(H)] for row in rows]

    def pack(self, vals):
        """Little-endian raw element bytes: f32, or bf16 as the top half of the (exact) f32 bit pattern."""
        b = struct.pack(f"<{len(vals)}f", *vals)
        if self.dtype == "f32":
            return b
        words = struct.unpack(f"<{len(vals)}I", b)
        assert all(w & 0xFFFF == 0 for w in words)
        return struct.pack(f"<{len(vals)}H", *(w >> 16 for w in words))

    def enc(self, nested):
        vals = list(flat(nested))
        shape, x = [], nested
        while isinstance(x, list):
            shape.append(len(x))
            x = x[0]
        return {"dtype": self.dtype, "shape": shape, "b64": base64.b64encode(self.pack(vals)).decode()}

    def write(self, t, rows, read, **kw):
        s = {"t": t, **kw, "read": read, "k": self.enc(self.block("k", rows)), "v": self.enc(self.block("v", rows))}
        s["q"] = None if read == "append" else self.enc(self.block("q", rows))
        return s

    def solo(self, req, positions, read):
        return self.write("solo", [[(req, p) for p in positions]], read, req=req, layer=0)

    def batch(self, rows, read):
        return self.write("batch", rows, read, layer=0)

    def chunk(self, rows, real):
        return {"t": "prefill_chunk", "layer": 0, **{f: self.enc(self.block(f, rows)) for f in ("k", "v", "q")},
                "real": real}

    def config(self):
        c = {"t": "config", "max_size": self.W, "dtype": self.dtype, "heads_kv": HKV, "heads_q": HQ,
             "head_dim": self.d, "layers": 1, "scale": SCALE}
        if self.quant is not None or self.d != D:
            c["family"] = "quant"
            c["quant"] = None if self.quant is None else {"bits": self.quant[0], "group": self.quant[1]}
        return c

    def view_sha(self, field, req, positions):
        """sha256 of the [H, n, D] view of these positions, straight from the floats."""
        vals = [x for h in range(HKV) for p in positions for x in self.tok(req, p)[field][h]]
        return hashlib.sha256(self.pack(vals)).hexdigest()


def flat(x):
    if isinstance(x, list):
        for y in x:
            yield from flat(y)
    else:
        yield x


class Script:
    def __init__(self):
        self.steps, self.expect = [], {}

    def add(self, step, check=None):
        if check is not None:
            self.expect[len(self.steps)] = check
        self.steps.append(step)


# ---------------------------------------------------------------------------------------------------------------
# the scenarios; `expect` maps a step index to a check on its result record
# ---------------------------------------------------------------------------------------------------------------
def rotating_scenario():
    """W = 4, f32: ring wraps, trims refused after the wrap, merge / extract / prefill / join / filter."""
    d, sc = Data(20240611, 4, "f32"), Script()
    add, solo, batch = sc.add, d.solo, d.batch
    add(d.config())
    add({"t": "admit", "req": 1})
    add({"t": "admit", "req": 2})
    # req 1: six single-token decodes; the ring wraps at the fifth (W = 4)
    add(solo(1, [0], "decode"))
    add(solo(1, [1], "decode"))
    add(solo(1, [2], "decode"), ("sdpa", [(1, [2], [0, 1, 2], None)]))  # before the wrap: temporal order
    add(solo(1, [3], "decode"))
    add(solo(1, [4], "decode"))
    add(solo(1, [5], "decode"), ("sdpa", [(1, [5], [4, 5, 2, 3], None)]))  # after the wrap: ring order
    add({"t": "solo_trim", "req": 1, "n": 1}, ("trimmed", 0))  # wrapped: mlx-lm refuses
    # req 2: one 6-token window read (concat path, sliding-window mask), then a decode that trims the buffer
    add(solo(2, range(6), "window"), ("sdpa", [(2, list(range(6)), list(range(6)), "window")]))
    add(solo(2, [6], "decode"))
    # req 3: trimmable before its ring fills
    add({"t": "admit", "req": 3})
    add(solo(3, [0, 1], "append"))
    add({"t": "solo_trim", "req": 3, "n": 1}, ("trimmed", 1))
    add({"t": "solo", "req": 99, "layer": 0, "read": "append", "k": None, "v": None, "q": None},
        ("error", "no solo cache"))
    add({"t": "checkpoint", "op": 1}, ("views", {1: (6, range(2, 6)), 2: (7, range(3, 7)), 3: (1, [0])}))
    # merge 1 and 2 into the running batch, decode, append, window read
    add({"t": "enter", "reqs": [1, 2], "how": "merge"})
    # merge took each row's temporal tail (positions 2..5 / 3..6); this decode overwrites the oldest column 0, and
    # no column is masked: each row equals a direct SDPA over the ring's physical order
    add(batch([[(1, 6)], [(2, 7)]], "decode"), ("sdpa", [(1, [6], [6, 3, 4, 5], None), (2, [7], [7, 4, 5, 6], None)]))
    add(batch([[(1, 7)], [(2, 8)]], "decode"), ("rows", 2))
    add(batch([[(1, 8)], [(2, 9)]], "append"))
    add(batch([[(1, 9), (1, 10)], [(2, 10), (2, 11)]], "window"), ("rows", 2))
    add({"t": "checkpoint", "op": 2}, ("views", {1: (11, range(7, 11)), 2: (12, range(8, 12)), 3: (1, [0])}))
    add({"t": "trim_rows", "n": [1, 2]}, ("unsupported",))
    add({"t": "trim_rows", "n": [1, 1]}, ("trimmed", 0))  # equal counts -> uniform trim, refused after the wrap
    add({"t": "trim", "n": 1}, ("trimmed", 0))
    add({"t": "extract", "row": 0, "finish": False})
    add({"t": "checkpoint", "op": 3}, ("views", {1: (11, range(7, 11)), 2: (12, range(8, 12)), 3: (1, [0])}))
    add(solo(1, [11], "decode"))
    # a right-padded prefill of two fresh requests (lengths 3 and 2), then one decode of the 3-row batch
    add({"t": "prefill", "reqs": [7, 8], "lengths": [3, 2]})
    add(d.chunk([[(7, 0), (7, 1), (7, 2)], [(8, 0), (8, 1), None]], [3, 2]),
        ("rows", 2, {0: (7, [0, 1, 2], [0, 1, 2], "window")}))  # row 0 has no padding
    add({"t": "prefill_end"})
    add(batch([[(2, 12)], [(7, 3)], [(8, 2)]], "decode"), ("rows", 3))
    add({"t": "checkpoint", "op": 4},
        ("views", {1: (12, range(8, 12)), 2: (13, range(9, 13)), 3: (1, [0]), 7: (4, range(0, 4)),
                   8: (3, range(0, 3))}))
    # req 1 comes back (join maps to merge), then rows 0, 2 and 3 are kept (req 7 is dropped)
    add({"t": "enter", "reqs": [1], "how": "join"})
    add({"t": "filter", "keep": [0, 2, 3]})
    add(batch([[(2, 13)], [(8, 3)], [(1, 12)]], "decode"), ("rows", 3))
    add({"t": "checkpoint", "op": 5},
        ("views", {1: (13, range(9, 13)), 2: (14, range(10, 14)), 3: (1, [0]), 8: (4, range(0, 4))}))
    return d, sc, {"unsupported": 1, "errors": 1}


def linear_scenario():
    """No window (KVCache / BatchKVCache), bf16: trims always allowed, left padding, a chunked right-padded prefill."""
    d, sc = Data(7, None, "bf16"), Script()
    add, solo, batch = sc.add, d.solo, d.batch
    add(d.config())
    add({"t": "admit", "req": 1})
    add({"t": "admit", "req": 2})
    add(solo(1, [0, 1, 2], "window"), ("sdpa", [(1, [0, 1, 2], [0, 1, 2], "causal")]))
    add(solo(1, [3], "decode"), ("sdpa", [(1, [3], [0, 1, 2, 3], None)]))
    add(solo(2, [0], "decode"))
    add(solo(2, [1], "decode"))
    add({"t": "solo_trim", "req": 1, "n": 2}, ("trimmed", 2))
    add(solo(1, [102], "decode"))  # a new token at position 2
    add({"t": "checkpoint", "op": 1}, ("views", {1: (3, [0, 1, 102]), 2: (2, [0, 1])}))
    add({"t": "enter", "reqs": [1, 2], "how": "merge"})  # row 1 gets one column of left padding
    add(batch([[(1, 103)], [(2, 2)]], "decode"), ("sdpa", [(1, [103], [0, 1, 102, 103], None)]))
    add({"t": "trim", "n": 1}, ("trimmed", 1))
    add(batch([[(1, 203)], [(2, 202)]], "decode"), ("rows", 2))
    add({"t": "checkpoint", "op": 2}, ("views", {1: (4, [0, 1, 102, 203]), 2: (3, [0, 1, 202])}))
    add({"t": "extract", "row": 1, "finish": True})
    add({"t": "checkpoint", "op": 3}, ("views", {1: (4, [0, 1, 102, 203])}))
    # lengths 2 and 4 in chunks of 2: the second chunk is all padding for row 0 (real 0)
    add({"t": "prefill", "reqs": [5, 6], "lengths": [2, 4]})
    add(d.chunk([[(5, 0), (5, 1)], [(6, 0), (6, 1)]], [2, 2]),
        ("rows", 2, {0: (5, [0, 1], [0, 1], "causal"), 1: (6, [0, 1], [0, 1], "causal")}))
    add(d.chunk([[None, None], [(6, 2), (6, 3)]], [0, 2]), ("rows", 2))
    add({"t": "prefill_end"})
    add(batch([[(1, 204)], [(5, 2)], [(6, 4)]], "decode"), ("rows", 3))
    add({"t": "checkpoint", "op": 4},
        ("views", {1: (5, [0, 1, 102, 203, 204]), 5: (3, [0, 1, 2]), 6: (5, [0, 1, 2, 3, 4])}))
    return d, sc, {"unsupported": 0, "errors": 0}


def quant_scenario():
    """The quantized family, linear, f32, D = 64: plain solo caches converted by `quantize` (KVCache.to_quantized),
    refused parameters, quantized reads and views, a fresh QuantizedKVCache, a trim, and the unsupported batch entry.
    Views are checked against mx.quantize of the floats, reads against a quantized attention written here."""
    d, sc = Data(12, None, "f32", dim=64), Script()
    add, solo = sc.add, d.solo
    add(d.config())
    add({"t": "admit", "req": 1})
    add({"t": "admit", "req": 2})
    add(solo(1, [0, 1, 2], "window"), ("sdpa", [(1, [0, 1, 2], [0, 1, 2], "causal")]))  # plain before conversion
    add(solo(2, [0], "decode"))
    add({"t": "quantize", "bits": 7, "group": 64}, ("error", "[quantize]"))  # mx.quantize refuses 7 bits on data
    add({"t": "checkpoint", "op": 1}, ("views", {1: (3, [0, 1, 2]), 2: (1, [0])}))  # nothing converted
    add({"t": "quantize", "bits": 4, "group": 64}, ("converted", True))
    add({"t": "checkpoint", "op": 2}, ("qviews", (4, 64), {1: (3, [0, 1, 2]), 2: (1, [0])}))
    add(solo(1, [3], "decode"), ("qsdpa", (4, 64), [(1, [3], [0, 1, 2, 3], None)]))
    add(solo(2, [1, 2], "window"), ("qsdpa", (4, 64), [(2, [1, 2], [0, 1, 2], "causal")]))
    add({"t": "quantize", "bits": 8, "group": 32}, ("converted", False))  # QuantizedKVCache has no to_quantized
    add({"t": "admit", "req": 3})  # now a QuantizedKVCache(64, 4)
    add(solo(3, [0, 1], "window"), ("qsdpa", (4, 64), [(3, [0, 1], [0, 1], "causal")]))
    add({"t": "solo_trim", "req": 3, "n": 1}, ("trimmed", 1))
    add({"t": "checkpoint", "op": 3}, ("qviews", (4, 64), {1: (4, [0, 1, 2, 3]), 2: (3, [0, 1, 2]), 3: (1, [0])}))
    # decision 16: the quantized batch is mapped row by row, each row its request's own QuantizedKVCache
    add({"t": "enter", "reqs": [1, 2], "how": "merge"})
    add({"t": "checkpoint", "op": 4}, ("qviews", (4, 64), {1: (4, [0, 1, 2, 3]), 2: (3, [0, 1, 2]), 3: (1, [0])}))
    add(d.batch([[(1, 4)], [(2, 3)]], "decode"),
        ("qsdpa", (4, 64), [(1, [4], [0, 1, 2, 3, 4], None), (2, [3], [0, 1, 2, 3], None)]))
    add({"t": "trim_rows", "n": [1, 0]}, ("trimmed_rows", [1, 0]))  # each row's own trim
    # a right-padded prefill: each row gets its real positions alone (row 1: one query, no mask)
    add({"t": "prefill", "reqs": [5, 6], "lengths": [2, 1]})
    add(d.chunk([[(5, 0), (5, 1)], [(6, 0), None]], [2, 1]),
        ("qsdpa", (4, 64), [(5, [0, 1], [0, 1], "causal"), (6, [0], [0], None)]))
    add({"t": "prefill_end"})
    add({"t": "checkpoint", "op": 5}, ("qviews", (4, 64), {1: (4, [0, 1, 2, 3]), 2: (4, [0, 1, 2, 3]), 3: (1, [0]),
                                                          5: (2, [0, 1]), 6: (1, [0])}))
    add({"t": "extract", "row": 0, "finish": True})
    add({"t": "filter", "keep": [1, 2]})
    add(d.batch([[(5, 2)], [(6, 1)]], "decode"),
        ("qsdpa", (4, 64), [(5, [2], [0, 1, 2], None), (6, [1], [0, 1], None)]))
    add({"t": "checkpoint", "op": 6}, ("qviews", (4, 64), {3: (1, [0]), 5: (3, [0, 1, 2]), 6: (2, [0, 1])}))
    return d, sc, {"unsupported": 0, "errors": 1}


def quant_wide_scenario():
    """mlx-lm's packed-width bug: a native QuantizedKVCache at 5 bits, D = 128, raises on its first write after
    advancing its offset."""
    d, sc = Data(5, None, "bf16", dim=128, quant=(5, 32)), Script()
    add, solo = sc.add, d.solo
    add(d.config())
    add({"t": "admit", "req": 1})
    add(solo(1, [0, 1], "window"), ("error", "broadcast_shapes"))  # 21 words allocated, mx.quantize gives 20
    add({"t": "checkpoint", "op": 1}, ("offsets", {1: 2}))  # the offset moved although nothing was stored
    return d, sc, {"unsupported": 0, "errors": 1}


def quant_rotating_scenario():
    """W = 4, f32, D = 64: a wrapped plain ring converted as laid out (the driver's RotatingQuantizedKVCache,
    decision 15): offset and phase kept, the next decode writes in place at the ring head (physical order
    [4, 5, 6, 3]), a window concatenates in temporal order keeping W - 1 columns, with the sliding-window mask of
    RotatingKVCache.make_mask; a trim after the wrap is refused as on a plain ring."""
    d, sc = Data(3, 4, "f32", dim=64), Script()
    add, solo = sc.add, d.solo
    add(d.config())
    add({"t": "admit", "req": 1})
    for p in range(6):
        add(solo(1, [p], "decode"))  # physical order [4, 5, 2, 3], write head at column 2
    add({"t": "quantize", "bits": 7, "group": 64}, ("error", "[quantize]"))  # mx.quantize refuses 7 bits
    add({"t": "checkpoint", "op": 1}, ("views", {1: (6, [2, 3, 4, 5])}))  # nothing changed
    add({"t": "quantize", "bits": 4, "group": 32}, ("converted", True))
    add({"t": "checkpoint", "op": 2}, ("qviews", (4, 32), {1: (6, [2, 3, 4, 5])}))
    add(solo(1, [6], "decode"), ("qsdpa", (4, 32), [(1, [6], [4, 5, 6, 3], None)]))
    sliding = [[True, True, True, True, False], [False, True, True, True, True]]  # causal, window 4, offset 3
    add(solo(1, [7, 8], "window"), ("qsdpa", (4, 32), [(1, [7, 8], [4, 5, 6, 7, 8], sliding)]))
    add({"t": "checkpoint", "op": 3}, ("qviews", (4, 32), {1: (9, [5, 6, 7, 8])}))
    add({"t": "solo_trim", "req": 1, "n": 1}, ("trimmed", 0))  # offset >= W: not trimmable
    add({"t": "admit", "req": 2})  # a RotatingQuantizedKVCache from now on
    add(solo(2, [0], "decode"), ("qsdpa", (4, 32), [(2, [0], [0], None)]))
    add({"t": "checkpoint", "op": 4}, ("qviews", (4, 32), {1: (9, [5, 6, 7, 8]), 2: (1, [0])}))
    return d, sc, {"unsupported": 0, "errors": 1}


def quant_rotating_native_scenario():
    """W = 4 with quantized storage from the start (RotatingQuantizedKVCache, decision 15), and its batch mapped row
    by row (decision 16): a merge lays each ring out in temporal order (as BatchRotatingKVCache.merge), each row
    then decodes in place on its own ring; a per-row trim is each row's own; an extract de-rolls the ring."""
    d, sc = Data(4, 4, "f32", dim=64, quant=(4, 64)), Script()
    add, solo = sc.add, d.solo
    add(d.config())
    add({"t": "admit", "req": 1})
    add({"t": "admit", "req": 2})
    add(solo(1, [0, 1, 2], "window"), ("qsdpa", (4, 64), [(1, [0, 1, 2], [0, 1, 2], "causal")]))
    add(solo(1, [3], "decode"), ("qsdpa", (4, 64), [(1, [3], [0, 1, 2, 3], None)]))
    add(solo(1, [4], "decode"), ("qsdpa", (4, 64), [(1, [4], [4, 1, 2, 3], None)]))  # wrapped: in place
    add(solo(2, [0, 1], "window"))
    add({"t": "enter", "reqs": [1, 2], "how": "merge"})  # row 0 laid out [1, 2, 3, 4], head at the end
    add(d.batch([[(1, 5)], [(2, 2)]], "decode"),
        ("qsdpa", (4, 64), [(1, [5], [5, 2, 3, 4], None), (2, [2], [0, 1, 2], None)]))
    add({"t": "checkpoint", "op": 1}, ("qviews", (4, 64), {1: (6, [2, 3, 4, 5]), 2: (3, [0, 1, 2])}))
    add({"t": "trim_rows", "n": [0, 1]}, ("trimmed_rows", [0, 1]))
    add({"t": "extract", "row": 0, "finish": False})  # de-rolled: [2, 3, 4, 5]
    add(solo(1, [6], "decode"), ("qsdpa", (4, 64), [(1, [6], [6, 3, 4, 5], None)]))
    add({"t": "checkpoint", "op": 2}, ("qviews", (4, 64), {1: (7, [3, 4, 5, 6]), 2: (2, [0, 1])}))
    return d, sc, {"unsupported": 0, "errors": 0}


SCENARIOS = {"selftest_steps.jsonl": rotating_scenario, "selftest_linear_steps.jsonl": linear_scenario,
             "selftest_quant_steps.jsonl": quant_scenario, "selftest_quant_wide_steps.jsonl": quant_wide_scenario,
             "selftest_quant_rotating_steps.jsonl": quant_rotating_scenario,
             "selftest_quant_rotating_native_steps.jsonl": quant_rotating_native_scenario}


# ---------------------------------------------------------------------------------------------------------------
def direct_sdpa_sha(d, req, q_pos, key_order, mask_kind):
    """Attention of `req`'s queries at q_pos over its keys in `key_order`, with mx.fast directly (no mlx-lm).
    mask_kind: None, "causal" (the string mask), or "window" (a hand-built bool mask, causal and, with a window,
    sliding; the block starts at position 0)."""
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    dt, words_dt, fmt = (mx.float32, mx.uint32, "I") if d.dtype == "f32" else (mx.bfloat16, mx.uint16, "H")
    q = mx.array(d.block("q", [[(req, p) for p in q_pos]]), dtype=mx.float32).astype(dt)
    k = mx.array(d.block("k", [[(req, p) for p in key_order]]), dtype=mx.float32).astype(dt)
    v = mx.array(d.block("v", [[(req, p) for p in key_order]]), dtype=mx.float32).astype(dt)
    mask = mask_kind
    if mask_kind == "window":
        W, n = d.W or len(key_order), len(key_order)
        mask = mx.array([[j <= i < j + W for j in range(n)] for i in range(n)])
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
    words = list(flat(out[0].view(words_dt).tolist()))
    return hashlib.sha256(struct.pack(f"<{len(words)}{fmt}", *words)).hexdigest()


def raw_words(arr, mx):
    """Little-endian raw element bytes of an mx array (uint32 / f32 as 4-byte words, bf16 as 2-byte words)."""
    words_dt, fmt = {mx.uint32: (mx.uint32, "I"), mx.float32: (mx.uint32, "I"), mx.bfloat16: (mx.uint16, "H")}[arr.dtype]
    words = list(flat(arr.view(words_dt).tolist()))
    return struct.pack(f"<{len(words)}{fmt}", *words)


def quant_view_sha(d, bits, group, field, req, positions):
    """sha256 of the (packed, scales, biases) bytes of mx.quantize over these positions' [H, n, D] floats (no
    mlx-lm; each position's groups are quantized independently, so one call over the view gives its bytes)."""
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    dt = mx.float32 if d.dtype == "f32" else mx.bfloat16
    x = mx.array(d.block(field, [[(req, p) for p in positions]])[0], dtype=mx.float32).astype(dt)
    return hashlib.sha256(b"".join(raw_words(a, mx) for a in mx.quantize(x, group_size=group, bits=bits))).hexdigest()


def direct_qsdpa_sha(d, quant, req, q_pos, key_order, mask_kind):
    """Quantized attention written here from MLX's ops (docs/quantized-kv.md "The read"): queries times the scale,
    GQA axes, quantized_matmul against mx.quantize of the keys, causal mask by where(.., finfo.min), precise
    softmax, quantized_matmul against the values. No mlx-lm."""
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    bits, group = quant
    dt = mx.float32 if d.dtype == "f32" else mx.bfloat16
    q = mx.array(d.block("q", [[(req, p) for p in q_pos]]), dtype=mx.float32).astype(dt)
    k = mx.array(d.block("k", [[(req, p) for p in key_order]]), dtype=mx.float32).astype(dt)
    v = mx.array(d.block("v", [[(req, p) for p in key_order]]), dtype=mx.float32).astype(dt)
    kq = mx.quantize(k, group_size=group, bits=bits)
    vq = mx.quantize(v, group_size=group, bits=bits)
    L, n, rep = len(q_pos), len(key_order), HQ // HKV
    q = (q * SCALE).reshape(1, HKV, rep, L, d.d)
    kq = [mx.expand_dims(a, -3) for a in kq]
    vq = [mx.expand_dims(a, -3) for a in vq]
    s = mx.quantized_matmul(q, *kq, transpose=True, group_size=group, bits=bits)
    if mask_kind == "causal":
        m = mx.arange(n - L, n)[:, None] >= mx.arange(n)[None]
        s = mx.where(m, s, mx.finfo(s.dtype).min)
    elif isinstance(mask_kind, list):  # a hand-written bool mask [L][n]
        s = mx.where(mx.array(mask_kind), s, mx.finfo(s.dtype).min)
    p = mx.softmax(s, axis=-1, precise=True)
    out = mx.quantized_matmul(p, *vq, transpose=False, group_size=group, bits=bits).reshape(1, HQ, L, d.d)
    return hashlib.sha256(raw_words(out[0], mx)).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# the recurrent family (`family: "ssm"`): ArraysCache + the gated-DeltaNet layer arithmetic
# ---------------------------------------------------------------------------------------------------------------
SSM = {"kernel": 3, "heads_k": 1, "heads_v": 2, "dk": 4, "dv": 4}
SSM_CD = 2 * SSM["heads_k"] * SSM["dk"] + SSM["heads_v"] * SSM["dv"]


class SsmData(Data):
    """Every (request, position) has its own qkv [conv_dim], a [Hv], b [Hv] (multiples of 1/16, exact in f32)."""

    def __init__(self, seed):
        super().__init__(seed, None, "f32")
        r = self.rng
        self.conv_w = [[[r.randint(-8, 8) / 16] for _ in range(SSM["kernel"])] for _ in range(SSM_CD)]
        self.a_log = [r.randint(-16, 16) / 16 for _ in range(SSM["heads_v"])]
        self.dt_bias = [r.randint(-16, 16) / 16 for _ in range(SSM["heads_v"])]

    def tok(self, req, pos):
        if (req, pos) not in self.tok_:
            r = self.rng
            self.tok_[(req, pos)] = {
                "qkv": [r.randint(-32, 32) / 16 for _ in range(SSM_CD)],
                "a": [r.randint(-16, 16) / 16 for _ in range(SSM["heads_v"])],
                "b": [r.randint(-16, 16) / 16 for _ in range(SSM["heads_v"])],
            }
        return self.tok_[(req, pos)]

    def config(self):
        return {"t": "config", "max_size": None, "dtype": "f32", "layers": 1, "family": "ssm", "ssm": SSM,
                "weights": [{"conv_weight": self.enc(self.conv_w), "a_log": self.enc(self.a_log),
                             "dt_bias": self.enc(self.dt_bias)}]}

    def call(self, t, rows, **kw):
        """rows = [[(req, pos) or None (padding: large values the mask must keep out of both states), ...]]."""
        def field(f, n):
            return [[self.tok(*rp)[f] if rp else [self.rng.randint(-99, 99) / 4 for _ in range(n)] for rp in row]
                    for row in rows]
        return {"t": t, "layer": 0, "read": "window", **kw, "qkv": self.enc(field("qkv", SSM_CD)),
                "a": self.enc(field("a", SSM["heads_v"])), "b": self.enc(field("b", SSM["heads_v"]))}

    def conv_sha(self, req, n):
        """sha256 of the request's conv state after n positions: its last K-1 qkv rows, zeros before its first."""
        K1 = SSM["kernel"] - 1
        rows = [[0.0] * SSM_CD if p < 0 else self.tok(req, p)["qkv"] for p in range(n - K1, n)]
        return hashlib.sha256(self.pack(list(flat(rows)))).hexdigest()


def direct_gdn(d, req, n):
    """The request's first n positions in one call, written here from MLX's ops (mx.conv1d, mx.fast.rms_norm, the
    delta rule step by step; no mlx-lm): returns (y [n, Hv, Dv], recurrent state [Hv, Dv, Dk])."""
    import mlx.core as mx
    import mlx.nn as nn
    K, Hk, Hv, Dk, Dv = (SSM[k] for k in ("kernel", "heads_k", "heads_v", "dk", "dv"))
    toks = [d.tok(req, p) for p in range(n)]
    qkv = mx.array([t["qkv"] for t in toks], dtype=mx.float32)[None]
    a = mx.array([t["a"] for t in toks], dtype=mx.float32)[None]
    b = mx.array([t["b"] for t in toks], dtype=mx.float32)[None]
    x = mx.concatenate([mx.zeros((1, K - 1, SSM_CD)), qkv], axis=1)
    conv = nn.silu(mx.conv1d(x, mx.array(d.conv_w), groups=SSM_CD))[0]
    q = conv[:, : Hk * Dk].reshape(n, Hk, Dk)
    k = conv[:, Hk * Dk: 2 * Hk * Dk].reshape(n, Hk, Dk)
    v = conv[:, 2 * Hk * Dk:].reshape(n, Hv, Dv)
    eps = 1e-6 / Dk
    q = (1.0 / Dk) * mx.fast.rms_norm(q, None, eps)
    k = (Dk ** -0.5) * mx.fast.rms_norm(k, None, eps)
    q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    beta = mx.sigmoid(b[0])
    g = mx.exp(-mx.exp(mx.array(d.a_log)) * nn.softplus(a[0] + mx.array(d.dt_bias)))
    S = mx.zeros((Hv, Dv, Dk))
    ys = []
    for t in range(n):
        S = S * g[t][:, None, None]
        kv = (S * k[t][:, None, :]).sum(axis=-1)
        delta = (v[t] - kv) * beta[t][:, None]
        S = S + k[t][:, None, :] * delta[:, :, None]
        ys.append((S * q[t][:, None, :]).sum(axis=-1))
    return mx.stack(ys), S


def ssm_scenario():
    """f32, K = 3, Hk = 1, Hv = 2: solo window / decode calls, a merge, a fresh request entering (its empty slots
    zero-filled by extend), a right-padded prepared prefill over the running batch (padded slots hold large values
    the mask must keep out), finalize, a fresh row left-padded, an extract that continues solo, a reordering filter,
    a speculative round without keep (unsupported), a rolled-back round re-synced by replay (decision 14), a finishing
    extract."""
    d, sc = SsmData(20251130), Script()
    add = sc.add
    add(d.config())
    add({"t": "admit", "req": 1})
    add({"t": "admit", "req": 2})
    add(d.call("solo", [[(1, 0), (1, 1), (1, 2)]], req=1), ("ssm_rows", [(1, 0, 3)]))
    add(d.call("solo", [[(2, 0)]], req=2, read="decode"), ("ssm_rows", [(2, 0, 1)]))
    add(d.call("solo", [[(1, 3)]], req=1, read="decode"), ("ssm_rows", [(1, 3, 4)]))
    add({"t": "enter", "reqs": [1, 2], "how": "merge"})
    add(d.call("batch", [[(1, 4)], [(2, 1)]], read="decode"), ("ssm_rows", [(1, 4, 5), (2, 1, 2)]))
    add({"t": "admit", "req": 3})
    add({"t": "enter", "reqs": [3], "how": "join"})
    add({"t": "prepare", "lengths": [2, 1, 3], "left": None})
    add(d.call("batch", [[(1, 5), (1, 6), None], [(2, 2), None, None], [(3, 0), (3, 1), (3, 2)]]),
        ("ssm_rows", [(1, 5, 7), (2, 2, 3), (3, 0, 3)]))
    add({"t": "finalize"})
    add({"t": "checkpoint", "op": 0}, ("ssm_views", {1: 7, 2: 3, 3: 3}))
    add({"t": "admit", "req": 4})
    add({"t": "enter", "reqs": [4], "how": "merge"})
    add({"t": "prepare", "lengths": [3, 3, 3, 3], "left": [0, 0, 0, 1]})
    add(d.call("batch", [[(1, 7), (1, 8), (1, 9)], [(2, 3), (2, 4), (2, 5)], [(3, 3), (3, 4), (3, 5)],
                         [None, (4, 0), (4, 1)]]),
        ("ssm_rows", [(1, 7, 10), (2, 3, 6), (3, 3, 6), (4, 0, 2)]))
    add({"t": "finalize"})
    add({"t": "extract", "row": 1, "finish": False})
    add({"t": "filter", "keep": [2, 0, 1]})
    add(d.call("solo", [[(2, 6)]], req=2, read="decode"), ("ssm_rows", [(2, 6, 7)]))
    add(d.call("batch", [[(4, 2)], [(1, 10)], [(3, 6)]], read="decode"),
        ("ssm_rows", [(4, 2, 3), (1, 10, 11), (3, 6, 7)]))
    add({"t": "checkpoint", "op": 1}, ("ssm_views", {1: 11, 2: 7, 3: 7, 4: 3}))
    add({"t": "round", "gamma": 2}, ("unsupported",))
    # a round's window (gamma = 2) over rows [4, 1, 3], rolled back to keep [2, 0, 1]: the driver re-syncs by
    # replaying each rolled-back row's accepted inputs from its pre-window slots (decision 14); the states must be
    # the direct computation over the accepted positions only
    add(d.call("batch", [[(4, 3), (4, 4)], [(1, 11), (1, 12)], [(3, 7), (3, 8)]]),
        ("ssm_rows", [(4, 3, 5), (1, 11, 13), (3, 7, 9)]))
    add({"t": "round", "gamma": 2, "keep": [2, 0, 1]}, ("trimmed_rows", [0, 2, 1]))
    add({"t": "checkpoint", "op": 2}, ("ssm_views", {1: 11, 2: 7, 3: 8, 4: 5}))
    add(d.call("batch", [[(4, 5)], [(1, 11)], [(3, 8)]], read="decode"),
        ("ssm_rows", [(4, 5, 6), (1, 11, 12), (3, 8, 9)]))
    add({"t": "extract", "row": 0, "finish": True})
    add({"t": "checkpoint", "op": 3}, ("ssm_views", {1: 12, 2: 7, 3: 9}))
    return d, sc, {"unsupported": 1, "errors": 0}


def ssm_rows_shas(d, spec):
    """Per row (req, p0, p1): sha256 of the direct computation's outputs at positions [p0, p1)."""
    import mlx.core as mx
    out = []
    for req, p0, p1 in spec:
        y, _ = direct_gdn(d, req, p1)
        out.append(hashlib.sha256(raw_words(y[p0:p1], mx)).hexdigest())
    return out


SCENARIOS["selftest_ssm_steps.jsonl"] = ssm_scenario


def run_scenario(name, make, write):
    d, sc, want_counts = make()
    path = os.path.join(HERE, name)
    text = "".join(json.dumps(s, separators=(",", ":")) + "\n" for s in sc.steps)
    if write:
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        if f.read() != text:
            return {"file": name, "result": "FAIL"}, [f"{name} is stale: run selftest.py --write"]

    with tempfile.TemporaryDirectory() as tmp:
        res_path = os.path.join(tmp, "results.jsonl")
        p = subprocess.run([sys.executable, os.path.join(HERE, "driver.py"), path, res_path],
                           capture_output=True, text=True)
        if p.returncode != 0:
            return {"file": name, "result": "FAIL"}, [f"driver failed ({p.returncode}): {p.stderr}"]
        summary = json.loads(p.stdout.strip().splitlines()[-1])
        with open(res_path) as f:
            results = [json.loads(line) for line in f]

    by_step = {r["step"]: r for r in results}
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(f"{name}: {what}")

    for i, exp in sorted(sc.expect.items()):
        r = by_step.get(i)
        kind = exp[0]
        if r is None:
            check(False, f"step {i}: no result record (expected {kind})")
            continue
        if kind == "sdpa":
            want = [direct_sdpa_sha(d, *args) for args in exp[1]]
            check(r.get("rows", [])[: len(want)] == want, f"step {i}: output {r} != direct SDPA {want}")
        elif kind == "qsdpa":
            want = [direct_qsdpa_sha(d, exp[1], *args) for args in exp[2]]
            check(r.get("rows", []) == want, f"step {i}: output {r} != direct quantized attention {want}")
        elif kind == "ssm_rows":
            want = ssm_rows_shas(d, exp[1])
            check(r.get("rows") == want, f"step {i}: outputs {r.get('rows')} != direct gated delta {want}")
        elif kind == "ssm_views":
            import mlx.core as mx
            got = r.get("reqs", {})
            check(sorted(got) == sorted(str(q) for q in exp[1]), f"step {i}: requests {sorted(got)} != {exp[1]}")
            for req, n in exp[1].items():
                g = got.get(str(req), {})
                check(g.get("offset") == n, f"step {i} req {req}: offset {g.get('offset')} != {n}")
                check(g.get("conv") == [d.conv_sha(req, n)], f"step {i} req {req}: conv state != last K-1 inputs")
                want = hashlib.sha256(raw_words(direct_gdn(d, req, n)[1], mx)).hexdigest()
                check(g.get("rec") == [want], f"step {i} req {req}: recurrent state != direct gated delta")
        elif kind == "converted":
            check(r.get("converted") is exp[1], f"step {i}: {r} expected converted {exp[1]}")
        elif kind == "qviews":
            (bits, group), views = exp[1], exp[2]
            got = r.get("reqs", {})
            check(sorted(got) == sorted(str(q) for q in views), f"step {i}: requests {sorted(got)} != {views}")
            for req, (offset, positions) in views.items():
                g = got.get(str(req), {})
                check(g.get("offset") == offset, f"step {i} req {req}: offset {g.get('offset')} != {offset}")
                for f in ("k", "v"):
                    want = [quant_view_sha(d, bits, group, f, req, list(positions))]
                    check(g.get(f) == want, f"step {i} req {req}: quantized {f.upper()} view differs")
        elif kind == "offsets":
            got = r.get("reqs", {})
            for req, offset in exp[1].items():
                check(got.get(str(req), {}).get("offset") == offset, f"step {i} req {req}: {got} offset != {offset}")
        elif kind == "trimmed":
            check(r.get("trimmed") == exp[1], f"step {i}: {r} expected trimmed {exp[1]}")
        elif kind == "trimmed_rows":
            check(r.get("trimmed_rows") == exp[1], f"step {i}: {r} expected trimmed_rows {exp[1]}")
        elif kind == "unsupported":
            check("unsupported" in r, f"step {i}: {r} expected unsupported")
        elif kind == "error":
            check(exp[1] in r.get("error", ""), f"step {i}: {r} expected an error with {exp[1]!r}")
        elif kind == "rows":
            rows = r.get("rows", [])
            check(len(rows) == exp[1] and all(len(h) == 64 for h in rows), f"step {i}: {r} expected {exp[1]} rows")
            for row, args in (exp[2] if len(exp) > 2 else {}).items():
                want = direct_sdpa_sha(d, *args)
                check(rows[row:row + 1] == [want], f"step {i} row {row}: {rows} != direct SDPA {want}")
        elif kind == "views":
            got = r.get("reqs", {})
            check(sorted(got) == sorted(str(q) for q in exp[1]), f"step {i}: requests {sorted(got)} != {exp[1]}")
            for req, (offset, positions) in exp[1].items():
                g = got.get(str(req), {})
                check(g.get("offset") == offset, f"step {i} req {req}: offset {g.get('offset')} != {offset}")
                check(g.get("k") == [d.view_sha("k", req, list(positions))], f"step {i} req {req}: K view differs")
                check(g.get("v") == [d.view_sha("v", req, list(positions))], f"step {i} req {req}: V view differs")
    unexpected = [r for r in results if ("error" in r or "unsupported" in r) and r["step"] not in sc.expect]
    check(not unexpected, f"unexpected error/unsupported records: {unexpected}")
    n_reads = sum(1 for i, s in enumerate(sc.steps) if s["t"] in ("solo", "batch", "prefill_chunk")
                  and s.get("read") != "append" and sc.expect.get(i, ("",))[0] != "error")
    want_summary = {"steps": len(sc.steps), "reads": n_reads, **want_counts, "mlx": "0.32.2", "mlx_lm": "0.32.2"}
    check(summary == want_summary, f"summary {summary} != {want_summary}")
    return {"file": name, "result": "FAIL" if failures else "PASS", "steps": len(sc.steps),
            "results": len(results), "checks": len(sc.expect) + 2, "summary": summary}, failures


def main():
    write = "--write" in sys.argv
    failures = []
    for name, make in SCENARIOS.items():
        line, fails = run_scenario(name, make, write)
        print(json.dumps(line))
        failures += fails
    for f in failures:
        print("  FAIL", f)
    print("selftest:", "FAIL" if failures else "PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
