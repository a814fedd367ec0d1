"""kvsim's block-pool requests (protocol 2, `supports.pool`) served by vllm-mlx 0.6.0's `PagedCacheManager`, and
its prefix-cache requests (`supports.prefix`) by its `MemoryAwarePrefixCache` or `BlockAwarePrefixCache`.

    PYTHONPATH=python oracles/vllm_mlx/.venv/bin/python -m kvsim.drivers.vllm_mlx [--lookup chain]
        [--prefix block] [--blocks N] [--plant cow-keeps-shared | prefix-short]

Each pool is a `vllm_mlx.paged_cache.PagedCacheManager`; kvsim's sequence `seq` is its request id `str(seq)`. The
driver only calls the manager (and, for `pool_hit`, makes the calls vllm-mlx's `BlockAwarePrefixCache.fetch_cache`
makes); it re-implements none of it and works around none of its bugs. The mapping (oracles/vllm_mlx/README.md,
"Decisions taken by the vllm-mlx driver"):

- `pool_new`: `PagedCacheManager(block_size=bs, max_blocks=blocks, enable_caching=True)`; `usable` = blocks - 1
  (block 0 is the manager's null block, never handed out).
- `pool_alloc`: `create_block_table(seq)`, `get_new_blocks(ceil(len / bs))` (its ValueError is the refusal; the table
  just made is then removed again, so a refusal changes nothing), `add_block_to_table(table, block, count)` per
  block, and per block a fresh `cache_data` list of `count` entries, a stand-in for the per-layer K/V list
  vllm-mlx stores there (`storage` reports its identity).
- `pool_free`: `delete_block_table(seq)`. `pool_fork`: `fork_block_table(table, new)`.
- `pool_cow`: `get_blocks_for_generation(table)`; `copied` = how many table entries it changed; `table` the
  manager's table after it.
- `pool_cache`: `cache_full_blocks(blocks of the table, tokens, 0, len(tokens) // bs)`.
- `pool_lookup` / `pool_hit`, by default (`--lookup block`) the lookup `BlockAwarePrefixCache.fetch_cache` makes:
  `find_shared_prefix(tokens)` (per-block hash of the block's own tokens); `pool_hit` then `create_block_table(seq)`
  and, per returned block, `increment_ref` and the block appended to the table, as `fetch_cache` does (a hit of
  nothing still makes the empty table: kvsim's sequence exists either way). `--lookup chain`:
  `get_computed_blocks(tokens)` (chain hash of the parent's hash and the block's tokens); `pool_hit` then
  `touch(blocks)` and `add_block_to_table` per block. `matched` = the tokens the blocks cover.
- `pool_evict`: `evict_lru_blocks(n)`, its return as `evicted`.
- `pool_info`: `free` = `free_blocks` (the free queue's count), `refs` = each block of `allocated_blocks` but the
  null block with its `ref_count`, `tables` = `request_tables`' block ids, `storage` = `id(block.cache_data)` of each
  of those blocks whose `cache_data` is not None.
- `--plant cow-keeps-shared` (a negative control, never the stock engine: hello's `version` says `+plant:...`):
  `pool_cow` answers the table unchanged and `copied` 0 without calling `get_blocks_for_generation`.

Prefix caches (oracles/vllm_mlx/README.md, "Prefix caches"; mlx-lm 0.31.3's `KVCache` per full-attention layer and
`RotatingKVCache(max_size=W, keep=0)` per window layer, each filled by one `update_and_fetch` of all positions):

- `--prefix memory` (default): `MemoryAwarePrefixCache(model, MemoryCacheConfig(max_memory_mb=1024,
  min_prefix_tokens=1))`; `prefix_insert`: `store(tokens, caches)`; `prefix_lookup`: `fetch(tokens)`, `matched` =
  len(tokens) - len(remaining) as the scheduler counts it; `prefix_evict`: `_evict_lru()`, one LRU step.
- `--prefix block`: `BlockAwarePrefixCache(model, PagedCacheManager(block_size, max_blocks=--blocks (64),
  enable_caching=True))`; `prefix_insert`: `store_cache(rid, tokens, states)` with `states` the scheduler's
  `_extract_cache_states` form (`state`, `meta_state`, `class_name`, `class_ref` per layer), the stored request's
  blocks kept held as the scheduler keeps them; `prefix_lookup`: `fetch_cache(rid, tokens)`, then
  `reconstruct_cache(table)` as the scheduler does (a failed reconstruction is a miss), `matched` = the table's
  `num_tokens` (the scheduler's `cached_tokens`), then the lookup's table deleted (its request dropped);
  `prefix_evict`: `release_cache` of the least recently stored request still held.
- `prefix_cold`: the same caches without the prefix cache. `--plant prefix-short` (a negative control): every
  restored layer answered one position short, `matched` kept.
"""
import types

from kvsim import kit

import vllm_mlx.paged_cache as PAGED  # standard library only: imports without stubs

_PREFIX = {}


def prefix_modules():
    """mlx-lm 0.31.3's cache module and vllm-mlx's prefix caches, loaded on the first prefix request (a pool run
    needs neither mlx nor them)."""
    if not _PREFIX:
        (cache,) = kit.load_modules("mlx_lm", ["models.cache"])  # first: vllm-mlx imports it by name
        mem, prefix = kit.load_modules("vllm_mlx", ["memory_cache", "prefix_cache"])
        _PREFIX.update(cache=cache, mem=mem, prefix=prefix)
    return _PREFIX


def mamba_module():
    """vllm-mlx's `utils.mamba_cache` (over mlx-lm 0.31.3's cache module), loaded on the first recurrent request."""
    if "mamba" not in _PREFIX:
        kit.load_modules("mlx_lm", ["models.cache"])  # first: mamba_cache imports it by name
        (_PREFIX["mamba"],) = kit.load_modules("vllm_mlx", ["utils.mamba_cache"])
    return _PREFIX["mamba"]


class VllmMlx(kit.RecCalls, kit.Driver):
    """vllm-mlx's block pools by the ids kvsim gives them."""

    name = "vllm-mlx"
    supports = {"kv": False, "pool": True, "prefix": True, "recurrent": True, "rec_prefill": True}
    options = {"lookup": ("block", "chain"), "plant": (None, "cow-keeps-shared", "prefix-short", "rec-neighbour"),
               "prefix": ("memory", "block"), "blocks": ("64", "8", "16", "32", "256", "1024"),
               "rec": ("mamba", "arrays"), "rec_prefill": ("yes", "no")}
    model = types.SimpleNamespace()  # the prefix caches' model: only its identity is used

    def version(self):
        v = kit.package_version("vllm-mlx")
        return v + (f"+plant:{self.opts['plant']}" if self.opts["plant"] else "")

    def hello_extra(self):
        return {"lookup": self.opts["lookup"], "prefix_cache": self.opts["prefix"], "recurrent": self.opts["rec"]}

    def op_pool_new(self, r):
        self.handles[r["id"]] = PAGED.PagedCacheManager(block_size=r["block_size"], max_blocks=r["blocks"],
                                                        enable_caching=True)
        return {"usable": r["blocks"] - 1}

    def op_pool_alloc(self, r):
        pool, seq, tokens = self.handles[r["id"]], str(r["seq"]), r["tokens"]
        bs = pool.block_size
        table = pool.create_block_table(seq)
        try:
            blocks = pool.get_new_blocks(-(-len(tokens) // bs))
        except ValueError:
            pool.delete_block_table(seq)  # the table is empty: nothing else to undo
            raise
        for i, block in enumerate(blocks):
            count = len(tokens[i * bs : (i + 1) * bs])
            pool.add_block_to_table(table, block, count)
            block.cache_data = [None] * count
        return {"table": list(table.block_ids)}

    def op_pool_free(self, r):
        self.handles[r["id"]].delete_block_table(str(r["seq"]))
        return {}

    def op_pool_fork(self, r):
        pool = self.handles[r["id"]]
        return {"table": list(pool.fork_block_table(pool.request_tables[str(r["seq"])], str(r["new"])).block_ids)}

    def op_pool_cow(self, r):
        pool = self.handles[r["id"]]
        table = pool.request_tables[str(r["seq"])]
        before = list(table.block_ids)
        if self.opts["plant"] != "cow-keeps-shared":
            pool.get_blocks_for_generation(table)
        after = list(table.block_ids)
        return {"table": after, "copied": sum(1 for a, b in zip(before, after) if a != b)}

    def op_pool_cache(self, r):
        pool, tokens = self.handles[r["id"]], r["tokens"]
        blocks = [pool.blocks[b] for b in pool.request_tables[str(r["seq"])].block_ids]
        pool.cache_full_blocks(blocks, tokens, 0, len(tokens) // pool.block_size)
        return {}

    def lookup(self, pool, tokens):
        """The blocks of the cached prefix of `tokens` and the tokens they cover."""
        if self.opts["lookup"] == "chain":
            blocks, matched = pool.get_computed_blocks(tokens)
            return blocks, matched
        ids, remaining = pool.find_shared_prefix(list(tokens))
        return [pool.blocks[b] for b in ids], len(tokens) - len(remaining)

    def op_pool_lookup(self, r):
        blocks, matched = self.lookup(self.handles[r["id"]], r["tokens"])
        return {"blocks": [b.block_id for b in blocks], "matched": matched}

    def op_pool_hit(self, r):
        pool = self.handles[r["id"]]
        blocks, matched = self.lookup(pool, r["tokens"])
        table = pool.create_block_table(str(r["seq"]))
        if self.opts["lookup"] == "chain":
            pool.touch(blocks)
            for b in blocks:
                pool.add_block_to_table(table, b, b.token_count)
        else:  # as BlockAwarePrefixCache.fetch_cache does
            for b in blocks:
                pool.increment_ref(b.block_id)
                if b.block_id in pool.allocated_blocks:
                    table.block_ids.append(b.block_id)
                    table.num_tokens += b.token_count
        return {"table": list(table.block_ids), "matched": matched}

    def op_pool_evict(self, r):
        return {"evicted": self.handles[r["id"]].evict_lru_blocks(r["n"])}

    def op_pool_info(self, r):
        pool = self.handles[r["id"]]
        held = {i: b for i, b in pool.allocated_blocks.items() if not b.is_null}
        return {
            "free": pool.free_blocks,
            "refs": {str(i): b.ref_count for i, b in sorted(held.items())},
            "tables": {s: list(t.block_ids) for s, t in pool.request_tables.items()},
            "storage": {str(i): id(b.cache_data) for i, b in sorted(held.items()) if b.cache_data is not None},
        }

    # ---- prefix caches ----

    def prefill(self, p, k, v):
        """Each layer's cache as a prefill of those positions makes it: one `update_and_fetch` of all of them."""
        cache = prefix_modules()["cache"]
        caches = []
        for w, kl, vl in zip(p["windows"], k, v):
            c = cache.RotatingKVCache(max_size=w, keep=0) if w else cache.KVCache()
            c.update_and_fetch(kit.arr_in(kl), kit.arr_in(vl))
            caches.append(c)
        return caches

    def op_prefix_new(self, r):
        m = prefix_modules()
        p = {"windows": [l.get("max_size") for l in r["layers"]], "stored": [], "n": 0,
             "geometry": {k: r[k] for k in ("heads_kv", "head_dim", "dtype")}}
        if self.opts["prefix"] == "memory":
            config = m["mem"].MemoryCacheConfig(max_memory_mb=1024, min_prefix_tokens=1)
            p["engine"] = m["mem"].MemoryAwarePrefixCache(self.model, config)
        else:
            pool = PAGED.PagedCacheManager(block_size=r["block_size"], max_blocks=int(self.opts["blocks"]),
                                           enable_caching=True)
            p["engine"] = m["prefix"].BlockAwarePrefixCache(self.model, pool)
        self.handles[r["id"]] = p
        return {}

    def request_id(self, p, what):
        p["n"] += 1
        return f"{what}-{p['n']}"

    def op_prefix_insert(self, r):
        p, tokens = self.handles[r["id"]], list(r["tokens"])
        caches = self.prefill(p, r["k"], r["v"])
        if self.opts["prefix"] == "memory":
            return {"stored": bool(p["engine"].store(tokens, caches))}
        # as Scheduler._extract_cache_states packs a finished request's caches (scheduler.py:1993)
        states = [{"state": c.state, "meta_state": c.meta_state, "class_name": type(c).__name__,
                   "class_ref": type(c)} for c in caches]
        rid = self.request_id(p, "insert")
        table = p["engine"].store_cache(rid, tokens, states)
        p["stored"].append(rid)
        return {"stored": table is not None, "blocks": list(table.block_ids) if table is not None else []}

    def op_prefix_lookup(self, r):
        p, tokens = self.handles[r["id"]], list(r["tokens"])
        short = self.opts["plant"] == "prefix-short"
        if self.opts["prefix"] == "memory":
            caches, remaining = p["engine"].fetch(tokens)
            if not caches:
                return {"matched": 0, "states": None}
            return {"matched": len(tokens) - len(remaining), "states": kit.layer_states(caches, p["geometry"], short)}
        rid = self.request_id(p, "lookup")
        table, remaining = p["engine"].fetch_cache(rid, tokens)
        try:
            if not table or table.num_tokens <= 0:
                return {"matched": 0, "states": None}
            caches = p["engine"].reconstruct_cache(table)
            if not caches:  # the scheduler treats a failed reconstruction as a miss
                return {"matched": 0, "states": None, "reconstructed": False}
            return {"matched": table.num_tokens, "states": kit.layer_states(caches, p["geometry"], short),
                    "blocks": list(table.block_ids), "remaining": len(remaining)}
        finally:
            p["engine"].paged_cache.delete_block_table(rid)

    def op_prefix_cold(self, r):
        p = self.handles[r["id"]]
        return {"states": kit.layer_states(self.prefill(p, r["k"], r["v"]), p["geometry"])}

    def op_prefix_evict(self, r):
        p = self.handles[r["id"]]
        if self.opts["prefix"] == "memory":
            before = len(p["engine"])
            p["engine"]._evict_lru()
            return {"evicted": before - len(p["engine"])}
        if not p["stored"]:
            return {"evicted": 0}
        p["engine"].release_cache(p["stored"].pop(0))
        return {"evicted": 1}

    # ---- recurrent state (BatchMambaCache; --rec arrays: mlx-lm 0.31.3's ArraysCache alone) ----

    def op_rec_new(self, r):
        self.handles[r["id"]] = mamba_module().MambaCache(size=len(r["arrays"]))
        return {}

    def op_rec_write(self, r):
        """Every array set to the state after the last step, as a model layer assigns `cache[i] = new_state`, then
        `advance(n)`; under a right-padded prompt (`rec_prepare`) through the cache's own `make_mask`, as mlx-lm's
        recurrent layers take it (kit.rec_masked_write)."""
        kit.rec_masked_write(self.handles[r["id"]], r["n"], r["states"])
        return {}

    def op_rec_merge(self, r):
        rows = [self.handles.pop(i) for i in r["rows"]]
        m = mamba_module()
        self.handles[r["id"]] = (m.BatchMambaCache if self.opts["rec"] == "mamba" else m.MambaCache).merge(rows)
        return {}


if __name__ == "__main__":
    kit.serve(VllmMlx)
