"""kvsim's K/V requests served by mlx-lm's own caches (oracles/PROTOCOL.md, "Decisions taken by the mlx-lm engine").

    PYTHONPATH=python oracles/mlx_lm/.venv/bin/python -m kvsim.drivers.mlx_lm [--plant prefix-short]

Every serial cache is mlx-lm's `KVCache` (`RotatingKVCache(max_size=W, keep=0)` under a sliding window), every batch
its `BatchKVCache` (`BatchRotatingKVCache`; made by the serial class's `merge`, grown by `extend`, shrunk by `extract`
and `filter`); reads take their mask from the cache before the write (`base.create_attention_mask`, as a model's
forward does) and attend through `mlx_lm.models.base.scaled_dot_product_attention`; trims go through
`trim_prompt_cache`. The driver only calls mlx-lm: it re-implements none of it and works around none of its bugs.

Prefix caches (protocol 2, `supports.prefix`; oracles/mlx_lm/README.md, "Prefix caches"): each is mlx-lm's
`LRUPromptCache()` (`models/cache.py`, the server's, with the server's default of 10 entries), keyed by one model
key. `prefix_insert`: a `KVCache` / `RotatingKVCache(max_size=W, keep=0)` per layer filled by one `update_and_fetch`
of all positions, then `insert_cache(model, tokens, caches)`; `prefix_lookup`: `fetch_nearest_cache(model, tokens)`,
`matched` = len(tokens) - len(rest) as the server counts it, the states of the caches it hands back (deep copies,
trimmed by `trim_prompt_cache` for a longer entry); `prefix_cold`: the same caches without the prefix cache;
`prefix_evict`: `trim_to(n_sequences=len - 1)`, one LRU step. `--plant prefix-short` (a negative control, hello's
`version` says `+plant:...`): every restored layer answered one position short, `matched` kept.

Recurrent state (`supports.recurrent`, `rec_prefill`): every cache is an `ArraysCache`, batched by its `merge`,
`extend`, `extract`, `filter`; a write sets each array as a model layer does, through the cache's own `make_mask`
and `advance` (`kit.rec_masked_write`), and a right-padded prompt batch is `prepare(lengths=..., right_padding=...)`
then `finalize()`, as `BatchGenerator.prompt` runs it (`--rec-prefill no`: none drawn). `--plant rec-neighbour`: a
filter's first kept row takes its neighbour's state; `--plant rec-pad-unmasked`: a write ignores the mask (a padded
row keeps its padding's state).

Two more K/V configurations (`--kv chunked|cachelist`; oracles/mlx_lm/README.md, "Chunked and list caches"):

- `--kv chunked`: every serial cache is a `ChunkedKVCache` (llama4's), `chunk_size=W` under a sliding window, else
  8192 (llama4's attention chunk, never reached by a run: the cache is then full attention). Each read calls
  `maybe_trim_front()` first, as llama4's forward does before its layers, takes the mask over the positions the cache
  holds from `base.create_causal_mask(L, offset=held, window_size=W)` (kvsim's sliding window, not llama4's chunk
  mask), then `update_and_fetch` and `base.scaled_dot_product_attention`. `state` is the newest `min(held, W)` of
  `keys_and_values()` (what the next read's `maybe_trim_front` keeps; nothing is trimmed for it). The class has no
  `merge` and mlx-lm batches none (`generate._merge_caches` raises): `merge` is refused. `--plant chunk-trim-over`:
  a trim that drops anything drops one position more than it answers.
- `--kv cachelist`: every cache is a `CacheList` of two caches of the geometry's class (as longcat-flash's
  `CacheList(KVCache(), KVCache())`): sub-cache 0 takes kvsim's `(k, v)` and serves the reads (mask from it, as the
  models take theirs from `cache[0]`), sub-cache 1 takes the same positions with K and V swapped, `(v, k)`, and
  serves `state`, `offset` and `rows_info` (swapped back), so that both sub-caches are checked and one handed in the
  other's place shows. Batches are `CacheList.merge`, `extend`, `extract`, `filter`, `prepare`, `finalize`; trims
  `trim_prompt_cache([cache_list], n)`. `--plant cachelist-index`: `merge` builds sub-cache 1 from the rows'
  sub-caches 0.
"""
from kvsim import kit

BASE, CACHE = kit.load_modules("mlx_lm", ["models.base", "models.cache"])


class MlxLm(kit.BatchCalls, kit.RecCalls, kit.Driver):
    """mlx-lm's caches by the ids kvsim gives them."""

    name = "mlx-lm"
    supports = {"kv": True, "serial_trim": True, "rows_window": True, "rows_trim": True, "join": False,
                "rotating": True, "prefill": True, "prefix": True, "recurrent": True, "rec_prefill": True}
    options = {"plant": (None, "prefix-short", "rec-neighbour", "chunk-trim-over", "cachelist-index",
                         "rollback-uniform", "rec-pad-unmasked"),
               "kv": ("plain", "quant", "chunked", "cachelist"), "prefill": ("yes", "no"), "trim_rows": ("no", "yes"),
               "rec_prefill": ("yes", "no")}
    chunk_full = 8192  # llama4's attention_chunk_size: the chunk of a full-attention run (no run reaches it)
    model = "kvsim"  # the model key of every prefix-cache call (the server's `model_key`)

    def version(self):
        v = kit.package_version("mlx-lm")
        v += f"+{self.opts['kv']}" if self.opts["kv"] != "plain" else ""
        return v + (f"+plant:{self.opts['plant']}" if self.opts["plant"] else "")

    def hello_extra(self):
        return {"mlx": kit.package_version("mlx")}

    def __init__(self, **opts):
        super().__init__(**opts)
        if self.opts["kv"] == "quant":
            # mlx-lm 0.32.2 quantizes only full-attention caches and batches none of them (QuantizedKVCache has no
            # `merge`; RotatingKVCache.to_quantized raises NotImplementedError): quantized serial caches only.
            self.supports = {"kv": True, "quant_only": True, "serial_trim": True, "prefix": False}
        elif self.opts["kv"] == "chunked":
            # serial only: ChunkedKVCache has no merge (every merge kvsim draws is refused, `op_merge`)
            self.supports = {"kv": True, "serial_trim": True, "rotating": True, "prefix": False}
        elif self.opts["kv"] == "cachelist":
            self.supports = dict(self.supports, prefix=False, recurrent=False)
        elif self.opts["prefill"] == "no":
            # the K/V runs of protocol 1 (no right-padded prefill drawn): the classes of the protocol-1 report again
            self.supports = dict(self.supports, prefill=False)
        if self.opts["trim_rows"] == "yes" and self.opts["kv"] == "plain":
            # per-row rollback (`rows_trim_rows`, `kit.rows_rollback`), full attention only: BatchKVCache takes right
            # padding alone (cache.py:938-957), BatchRotatingKVCache only with a prefill's `lengths` (:1243-1254).
            # Opt-in, so the recorded runs stay as they were.
            self.supports = dict(self.supports, rows_trim_rows=True, rotating=False)

    def op_new(self, r):
        self.geometry = g = r["geometry"]
        w, q, kv = g.get("max_size"), g.get("quant"), self.opts["kv"]
        if q:
            c = CACHE.QuantizedKVCache(group_size=q["group_size"], bits=q["bits"])
        elif kv == "chunked":
            c = CACHE.ChunkedKVCache(chunk_size=w or self.chunk_full)
        elif kv == "cachelist":
            c = CACHE.CacheList(*(CACHE.RotatingKVCache(max_size=w, keep=0) if w else CACHE.KVCache() for _ in "01"))
        else:
            c = CACHE.RotatingKVCache(max_size=w, keep=0) if w else CACHE.KVCache()
        self.handles[r["id"]] = c
        return {}

    def op_window(self, r):
        c = self.handles[r["id"]]
        k, v, q = kit.arr_in(r["k"]), kit.arr_in(r["v"]), kit.arr_in(r["q"])
        w = self.geometry.get("max_size")
        if isinstance(c, CACHE.ChunkedKVCache):
            # llama4's order: the front trimmed before the layer writes; the mask over the positions held (its
            # sliding window of W, or causal), built by mlx-lm's `create_causal_mask`
            c.maybe_trim_front()
            mask = BASE.create_causal_mask(q.shape[2], offset=c.offset - c.start_position, window_size=w)
        elif isinstance(c, CACHE.CacheList):
            c[1].update_and_fetch(v, k)  # the second stream: the same positions, K and V swapped
            c = c[0]
            mask = BASE.create_attention_mask(q.transpose(0, 2, 1, 3), c, window_size=w)
        else:
            # the mask of the cache before the write, as a model's forward builds it
            mask = BASE.create_attention_mask(q.transpose(0, 2, 1, 3), c, window_size=w)
        keys, values = c.update_and_fetch(k, v)
        out = BASE.scaled_dot_product_attention(q, keys, values, c, scale=r["scale"], mask=mask)
        return {"out": kit.arr_out(out)}

    op_decode = op_rows_window = op_rows_decode = op_window

    def op_trim(self, r):
        c = self.handles[r["id"]]
        trimmed = CACHE.trim_prompt_cache([c], r["n"])
        if self.opts["plant"] == "chunk-trim-over" and isinstance(c, CACHE.ChunkedKVCache) and trimmed:
            c.trim(1)  # a negative control: a trim drops one position more than it answers
        return {"trimmed": trimmed}

    op_rows_trim = op_trim

    def op_rows_trim_rows(self, r):
        uniform = self.opts["plant"] == "rollback-uniform"  # a negative control: every row drops the most
        trim = lambda c, n: CACHE.trim_prompt_cache([c], n)
        return {"trimmed": kit.rows_rollback(self.handles[r["id"]], r["n"], trim, uniform)}

    def state_of(self, c):
        """The K/V the next read attends, oldest first: the first `offset` columns of a KVCache (the planes of a
        QuantizedKVCache); the newest min(offset, W) of a RotatingKVCache in temporal order (its `_temporal_order`);
        the newest min(held, W) of what a ChunkedKVCache holds (`keys_and_values()`; all it holds without a window);
        a CacheList's sub-cache 1, K and V swapped back."""
        if isinstance(c, CACHE.CacheList):
            out = kit.state_reply(c[1], self.geometry)
            return {"k": out["v"], "v": out["k"]}
        if isinstance(c, CACHE.ChunkedKVCache) and c.keys is not None:
            k, v = c.keys_and_values()
            w = self.geometry.get("max_size")
            n = min(k.shape[2], w) if w else k.shape[2]
            return {"k": kit.arr_out(k[..., k.shape[2] - n :, :]), "v": kit.arr_out(v[..., v.shape[2] - n :, :])}
        return kit.state_reply(c, self.geometry)

    def op_state(self, r):
        return self.state_of(self.handles[r["id"]])

    @staticmethod
    def offset_of(c):
        return (c[1] if isinstance(c, CACHE.CacheList) else c).offset

    def op_offset(self, r):
        return {"offset": int(self.offset_of(self.handles[r["id"]]))}

    def op_merge(self, r):
        rows = [self.handles.pop(i) for i in r["rows"]]
        if not hasattr(rows[0], "merge"):  # ChunkedKVCache: refused as mlx-lm's batching refuses it
            raise NotImplementedError(f"{type(rows[0]).__name__} has no merge: mlx-lm batches none "
                                      "(generate._merge_caches: \"does not yet support batching with history\")")
        batch = rows[0].merge(rows)
        if self.opts["plant"] == "cachelist-index" and isinstance(batch, CACHE.CacheList):
            # a negative control: sub-cache 1 of the batch built from the rows' sub-caches 0
            batch.caches = (batch.caches[0], rows[0].caches[0].merge([c.caches[0] for c in rows]))
        self.handles[r["id"]] = batch
        return {}

    # ---- prefix caches ----

    def prefill(self, p, k, v):
        """Each layer's cache as a prefill of those positions makes it: one `update_and_fetch` of all of them."""
        caches = []
        for w, kl, vl in zip(p["windows"], k, v):
            c = CACHE.RotatingKVCache(max_size=w, keep=0) if w else CACHE.KVCache()
            c.update_and_fetch(kit.arr_in(kl), kit.arr_in(vl))
            caches.append(c)
        return caches

    def op_prefix_new(self, r):
        self.handles[r["id"]] = {"lru": CACHE.LRUPromptCache(), "windows": [l.get("max_size") for l in r["layers"]],
                                 "geometry": {k: r[k] for k in ("heads_kv", "head_dim", "dtype")}}
        return {}

    def op_prefix_insert(self, r):
        p = self.handles[r["id"]]
        p["lru"].insert_cache(self.model, list(r["tokens"]), self.prefill(p, r["k"], r["v"]))
        return {}

    def op_prefix_lookup(self, r):
        p, tokens = self.handles[r["id"]], list(r["tokens"])
        caches, rest = p["lru"].fetch_nearest_cache(self.model, tokens)
        if caches is None:
            return {"matched": 0, "states": None}
        short = self.opts["plant"] == "prefix-short"
        return {"matched": len(tokens) - len(rest), "states": kit.layer_states(caches, p["geometry"], short)}

    def op_prefix_cold(self, r):
        p = self.handles[r["id"]]
        return {"states": kit.layer_states(self.prefill(p, r["k"], r["v"]), p["geometry"])}

    def op_prefix_evict(self, r):
        lru = self.handles[r["id"]]["lru"]
        before = len(lru)
        lru.trim_to(n_sequences=before - 1)
        return {"evicted": before - len(lru)}

    # ---- recurrent state (ArraysCache) ----

    def op_rec_new(self, r):
        self.handles[r["id"]] = CACHE.ArraysCache(len(r["arrays"]))
        return {}

    def op_rec_write(self, r):
        """Every array set to the state after the last step, as a model layer assigns `cache[i] = new_state`, then
        `advance(n)`; under a right-padded prompt (`rec_prepare`) through the cache's own `make_mask`, as mlx-lm's
        recurrent layers take it (kit.rec_masked_write)."""
        kit.rec_masked_write(self.handles[r["id"]], r["n"], r["states"], self.opts["plant"] == "rec-pad-unmasked")
        return {}


if __name__ == "__main__":
    kit.serve(MlxLm)
