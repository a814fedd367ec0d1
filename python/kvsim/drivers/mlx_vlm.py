"""kvsim's prefix-cache, recurrent and (with `--kv`) K/V requests served by mlx-vlm 0.7.10's own caches. Prefix caches
(protocol 2, `supports.prefix`): mlx-vlm's automatic prefix caching in its exact-checkpoint mode (`mlx_vlm/apc.py`
`APCManager.store_exact_cache` / `lookup_exact_cache`, whose copies go through the caches' `prefix_cache_snapshot` /
`prefix_cache_restore`, `mlx_vlm/models/cache.py`).

    PYTHONPATH=python oracles/mlx_vlm/.venv/bin/python -m kvsim.drivers.mlx_vlm [--plant prefix-short] \
        [--kv plain|quant|buffered|convert [--plant quant-row-copy]]

Every layer's cache is mlx-vlm's own `KVCache` / `RotatingKVCache(max_size=W, keep=0)`, filled by one
`update_and_fetch` of all positions. The mapping (oracles/mlx_vlm/README.md, "Prefix caches"):

- `prefix_new`: `APCManager(num_blocks=64, block_size=bs, overrides={"checkpoint_entries": 10})` with
  `APC_EXACT_MIN_TOKENS=1` in the environment (its default, 16 tokens, is longer than any kvsim sequence).
- `prefix_insert`: `store_exact_cache(tokens, caches)`. `prefix_lookup`: `lookup_exact_cache(tokens)` -> (caches,
  prefix length); `matched` is that length. `prefix_cold`: the same caches without the manager.
- `prefix_evict`: one step of the LRU the manager runs over its checkpoints (`_exact_cache.popitem(last=False)`, as
  its entry cap and `_make_room` do).
- `--plant prefix-short` (a negative control, `version` says `+plant:...`): every restored layer answered one
  position short, `matched` kept.

K/V requests (protocol 1's, `supports.quant` planes, `supports.prefill`) with `--kv plain|quant|buffered|convert`, served by
mlx-vlm's own classes in `mlx_vlm/models/cache.py` (oracles/mlx_vlm/README.md, "K/V caches"):

- `--kv plain`: `KVCache` / `RotatingKVCache(max_size=W, keep=0)`, batched by the class's `merge` into
  `BatchKVCache` / `BatchRotatingKVCache` (grown by `extend`, shrunk by `extract` and `filter`, readied for a
  right-padded prefill by `prepare` and ended by `finalize`).
- `--kv quant` (every run quantized, full attention: mlx-vlm has no quantized ring): `QuantizedKVCache(group_size,
  bits)`, batched into a `BatchQuantizedKVCache` by `QuantizedKVCache.prefix_cache_merge(rows, offsets)` (the class
  has no `merge`; this is the batch it builds from single-request caches).
- `--kv convert` (full attention, serial): half the runs quantized from the first write, the other half `KVCache`
  until kvsim's conversion op, served by `KVCache.to_quantized(group_size, bits)`.
- `--kv buffered`: window layers are `BufferedRotatingKVCache(max_size=W, keep=0, buffer_size=64)` (the ring with
  rollback slack of mlx-vlm's speculative drafters), batched by the `merge` it inherits (`BatchRotatingKVCache`).

Reads take their mask from the cache before the write (`models/base.py` `create_attention_mask`) and attend through
`models/base.py` `scaled_dot_product_attention` (its quantized path where the cache has `bits`). Trims call the cache's
`trim(n)` where `is_trimmable()` says so, else answer 0 (the guard mlx-vlm's callers use). A state or read output of
another float dtype than the run's is refused rather than sent (`state_of`). `--plant quant-row-copy`
(with `--kv quant`): after every decode of a batch of two rows or more, row 1's newest packed K column takes row 0's.
"""
import os

from kvsim import kit

CACHE, APC = kit.load_modules("mlx_vlm", ["models.cache", "apc"])
BASE = None  # mlx_vlm.models.base, loaded by the K/V modes (it imports PIL)


class MlxVlm(kit.BatchCalls, kit.RecCalls, kit.Driver):
    """mlx-vlm's exact-checkpoint prefix caches, recurrent caches and K/V caches by the ids kvsim gives them."""

    name = "mlx-vlm"
    supports = {"kv": False, "prefix": True, "recurrent": True, "rec_spec": True, "rec_prefill": True}
    options = {"plant": (None, "prefix-short", "rec-neighbour", "quant-row-copy", "rollback-uniform"),
               "kv": (None, "plain", "quant", "buffered", "convert"), "trim_rows": ("no", "yes"),
               "rec_prefill": ("yes", "no")}

    def __init__(self, **opts):
        super().__init__(**opts)
        kv = self.opts["kv"]
        if kv:
            global BASE
            BASE, = kit.load_modules("mlx_vlm", ["models.base"])  # needs PIL: loaded for the K/V requests only
            rows = {"kv": True, "serial_trim": True, "rows_window": True, "rows_trim": True, "join": False,
                    "prefill": True}
            if kv == "quant":  # full attention only: mlx-vlm has no quantized ring (RotatingKVCache.to_quantized)
                rows.update(quant_only=True, quant_rows=True)
            elif kv == "convert":  # half the runs plain until kvsim's conversion op (`KVCache.to_quantized`); serial
                rows.update(quant=True, convert=True, quant_rows=False, prefill=False)
            else:
                rows.update(rotating=True)
            if self.opts["trim_rows"] == "yes" and kv in ("plain", "quant"):
                # per-row rollback, `kit.rows_rollback` (LFM2's own sequence), full attention only: the batch ring's
                # `prepare` takes right padding only with a prefill's `lengths` (models/cache.py:1935-1946)
                rows.update(rows_trim_rows=True, rotating=False)
            self.supports = dict(self.supports, **rows)

    def version(self):
        v = kit.package_version("mlx-vlm") + (f"+{self.opts['kv']}" if self.opts["kv"] else "")
        return v + (f"+plant:{self.opts['plant']}" if self.opts["plant"] else "")

    def hello_extra(self):
        return {"mlx": kit.package_version("mlx"), "prefix_cache": "exact"}

    def prefill(self, p, k, v):
        """Each layer's cache as a prefill of those positions makes it: one `update_and_fetch` of all of them."""
        caches = []
        for w, kl, vl in zip(p["windows"], k, v):
            c = CACHE.RotatingKVCache(max_size=w, keep=0) if w else CACHE.KVCache()
            c.update_and_fetch(kit.arr_in(kl), kit.arr_in(vl))
            caches.append(c)
        return caches

    def op_prefix_new(self, r):
        os.environ["APC_EXACT_MIN_TOKENS"] = "1"  # read by APCManager.__init__
        apc = APC.APCManager(num_blocks=64, block_size=r["block_size"], overrides={"checkpoint_entries": 10})
        self.handles[r["id"]] = {"apc": apc, "windows": [l.get("max_size") for l in r["layers"]],
                                 "geometry": {k: r[k] for k in ("heads_kv", "head_dim", "dtype")}}
        return {}

    def op_prefix_insert(self, r):
        p = self.handles[r["id"]]
        return {"stored": bool(p["apc"].store_exact_cache(list(r["tokens"]), self.prefill(p, r["k"], r["v"])))}

    def op_prefix_lookup(self, r):
        p = self.handles[r["id"]]
        caches, n = p["apc"].lookup_exact_cache(list(r["tokens"]))
        if caches is None or n <= 0:
            return {"matched": 0, "states": None}
        short = self.opts["plant"] == "prefix-short"
        return {"matched": int(n), "states": kit.layer_states(caches, p["geometry"], short)}

    def op_prefix_cold(self, r):
        p = self.handles[r["id"]]
        return {"states": kit.layer_states(self.prefill(p, r["k"], r["v"]), p["geometry"])}

    def op_prefix_evict(self, r):
        apc = self.handles[r["id"]]["apc"]
        with apc.lock:
            if not apc._exact_cache:
                return {"evicted": 0}
            apc._exact_cache.popitem(last=False)
        return {"evicted": 1}

    # ---- K/V caches (--kv plain | quant | buffered) ----

    def op_new(self, r):
        self.geometry = g = r["geometry"]
        q, w = g.get("quant"), g.get("max_size")
        if q:
            c = CACHE.QuantizedKVCache(group_size=q["group_size"], bits=q["bits"])
        elif w and self.opts["kv"] == "buffered":
            c = CACHE.BufferedRotatingKVCache(max_size=w, keep=0)
        elif w:
            c = CACHE.RotatingKVCache(max_size=w, keep=0)
        else:
            c = CACHE.KVCache()
        self.handles[r["id"]] = c
        return {}

    def op_window(self, r):
        c = self.handles[r["id"]]
        k, v, q = kit.arr_in(r["k"]), kit.arr_in(r["v"]), kit.arr_in(r["q"])
        # the mask of the cache before the write, as a model's forward builds it
        mask = BASE.create_attention_mask(q.transpose(0, 2, 1, 3), c, window_size=self.geometry.get("max_size"))
        keys, values = c.update_and_fetch(k, v)
        out = BASE.scaled_dot_product_attention(q, keys, values, c, scale=r["scale"], mask=mask)
        if out.dtype != q.dtype:  # refused, not a malformed reply (as `state_of`)
            raise TypeError(f"the read's output is {out.dtype} for {q.dtype} queries")
        return {"out": kit.arr_out(out)}

    op_decode = op_rows_window = op_window

    def op_rows_decode(self, r):
        out = self.op_window(r)
        c = self.handles[r["id"]]
        if self.opts["plant"] == "quant-row-copy" and isinstance(c.keys, tuple) and c.keys[0].shape[0] >= 2:
            col = int(c._idx) - 1  # a negative control: row 1's newest packed K column takes row 0's
            c.keys[0][1, :, col, :] = c.keys[0][0, :, col, :]
        return out

    def op_convert(self, r):
        """`to_quantized(group_size, bits)`, as `generate/common.py:235-244` (`maybe_quantize_kv_cache`) converts each
        layer: a new object under the same id (the old one kept when it raises)."""
        q = r["quant"]
        self.handles[r["id"]] = self.handles[r["id"]].to_quantized(group_size=q["group_size"], bits=q["bits"])
        self.geometry = dict(self.geometry, quant=q)  # kvsim converts every cache of the run at once
        return {}

    def op_trim(self, r):
        c = self.handles[r["id"]]
        return {"trimmed": int(c.trim(r["n"])) if c.is_trimmable() else 0}

    op_rows_trim = op_trim

    def op_rows_trim_rows(self, r):
        uniform = self.opts["plant"] == "rollback-uniform"  # a negative control: every row drops the most
        trim = lambda c, n: int(c.trim(n)) if c.is_trimmable() else 0
        return {"trimmed": kit.rows_rollback(self.handles[r["id"]], r["n"], trim, uniform)}

    def state_of(self, c):
        """`kit.state_reply` of `c`, refused when its float planes are not of the run's dtype: an mlx-vlm batch can
        turn a bf16 cache into f32 (README, "K/V caches"), which kvsim would read as a malformed reply and stop the
        whole check; as a refusal the run's class is named, shrunk and reproduced like any other."""
        out = kit.state_reply(c, self.geometry)
        for side in ("k", "v"):
            a = out[side]["scales"] if self.geometry.get("quant") else out[side]
            if a["dtype"] != self.geometry["dtype"]:
                raise TypeError(f"the cache's {side} is {a['dtype']} in a {self.geometry['dtype']} run")
        return out

    def op_state(self, r):
        return self.state_of(self.handles[r["id"]])

    def op_offset(self, r):
        return {"offset": int(self.handles[r["id"]].offset)}

    def op_merge(self, r):
        rows = [self.handles.pop(i) for i in r["rows"]]
        if isinstance(rows[0], CACHE.QuantizedKVCache):
            batch = rows[0].prefix_cache_merge(rows, [int(c.offset) for c in rows])
            if batch is None:
                raise ValueError("QuantizedKVCache.prefix_cache_merge refused the rows (returned None)")
        else:
            batch = rows[0].merge(rows)
        self.handles[r["id"]] = batch
        return {}

    # ---- recurrent state (ArraysCache and its speculation API) ----

    def op_rec_new(self, r):
        self.handles[r["id"]] = CACHE.ArraysCache(len(r["arrays"]))
        self.rec_kinds = [a["kind"] for a in r["arrays"]]
        return {}

    def op_rec_write(self, r):
        """Each array through the cache's own transition entry points, as mlx-vlm's layers call them (e.g.
        `models/qwen3_5/language.py`): a conv window by `update_window(i, concatenate([window, columns]), width)`,
        the window the cache holds (zeros before the first write) followed by the new columns kvsim sent (the last
        column of each step's window); an SSM state by `update_recurrent(i, n, update)`, whose `update` returns kvsim's
        states (the last as the final state, the others as the history a speculative block records)."""
        import mlx.core as mx

        c = self.handles[r["id"]]
        mask = c.make_mask(r["n"])
        for i, (s, kind) in enumerate(zip(r["states"], self.rec_kinds)):
            x = kit.arr_in(s)
            if kind == "conv":
                width = x.shape[2]
                window = c[i] if c[i] is not None else mx.zeros((x.shape[0], width, x.shape[3]), dtype=x.dtype)
                c.update_window(i, mx.concatenate([window, x[:, :, -1, :]], axis=1), width, lengths=c.lengths)
            else:
                c.update_recurrent(i, x.shape[1], lambda state, steps, x=x: (
                    None, kit.rec_last_kept(x, mask, state), None if steps is None else x[:, :-1]))
        c.advance(r["n"])
        return {}

    def op_rec_spec_start(self, r):
        self.handles[r["id"]].start_speculation(r["n"])
        return {}

    def op_rec_spec_commit(self, r):
        self.handles[r["id"]].commit_speculation(list(r["accept"]))
        return {}

    def op_rec_spec_abort(self, r):
        self.handles[r["id"]].abort_speculation()
        return {}


if __name__ == "__main__":
    kit.serve(MlxVlm)
