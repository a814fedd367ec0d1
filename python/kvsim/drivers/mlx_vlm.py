"""kvsim's prefix-cache requests (protocol 2, `supports.prefix`) served by mlx-vlm 0.7.10's automatic prefix caching
in its exact-checkpoint mode (`mlx_vlm/apc.py` `APCManager.store_exact_cache` / `lookup_exact_cache`, whose copies go
through the caches' `prefix_cache_snapshot` / `prefix_cache_restore`, `mlx_vlm/models/cache.py`).

    PYTHONPATH=python oracles/mlx_vlm/.venv/bin/python -m kvsim.drivers.mlx_vlm [--plant prefix-short]

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
"""
import os

from kvsim import kit

CACHE, APC = kit.load_modules("mlx_vlm", ["models.cache", "apc"])


class MlxVlm(kit.Driver):
    """mlx-vlm's exact-checkpoint prefix caches by the ids kvsim gives them."""

    name = "mlx-vlm"
    supports = {"kv": False, "prefix": True, "recurrent": True, "rec_spec": True}
    options = {"plant": (None, "prefix-short", "rec-neighbour")}

    def version(self):
        v = kit.package_version("mlx-vlm")
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
        for i, (s, kind) in enumerate(zip(r["states"], self.rec_kinds)):
            x = kit.arr_in(s)
            if kind == "conv":
                width = x.shape[2]
                window = c[i] if c[i] is not None else mx.zeros((x.shape[0], width, x.shape[3]), dtype=x.dtype)
                c.update_window(i, mx.concatenate([window, x[:, :, -1, :]], axis=1), width)
            else:
                c.update_recurrent(i, x.shape[1], lambda state, steps, x=x: (None, x[:, -1], None if steps is None
                                                                              else x[:, :-1]))
        return {}

    def op_rec_merge(self, r):
        rows = [self.handles.pop(i) for i in r["rows"]]
        self.handles[r["id"]] = rows[0].merge(rows)
        return {}

    def op_rec_extend(self, r):
        self.handles[r["id"]].extend(self.handles.pop(r["other"]))
        return {}

    def op_rec_filter(self, r):
        c, keep = self.handles[r["id"]], list(r["keep"])
        if self.opts["plant"] == "rec-neighbour" and keep[0] + 1 < c.batch_size and keep[0] + 1 not in keep:
            keep[0] += 1  # a negative control: the first kept row takes its neighbour's state
        c.filter(keep)
        return {}

    def op_rec_extract(self, r):
        self.handles[r["new"]] = self.handles[r["id"]].extract(r["row"])
        return {}

    def op_rec_state(self, r):
        return kit.rec_arrays(self.handles[r["id"]].cache)

    def op_rec_rows_state(self, r):
        return kit.rec_arrays(self.handles[r["id"]].cache, r["row"])

    def op_rec_rows_info(self, r):
        return {"rows": int(self.handles[r["id"]].batch_size)}

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
