"""kvsim's K/V requests served by mlx-lm's own caches (oracles/PROTOCOL.md, "Decisions taken by the mlx-lm engine").

    PYTHONPATH=python oracles/mlx_lm/.venv/bin/python -m kvsim.drivers.mlx_lm

Every serial cache is mlx-lm's `KVCache` (`RotatingKVCache(max_size=W, keep=0)` under a sliding window), every batch
its `BatchKVCache` (`BatchRotatingKVCache`; made by the serial class's `merge`, grown by `extend`, shrunk by `extract`
and `filter`); reads take their mask from the cache before the write (`base.create_attention_mask`, as a model's
forward does) and attend through `mlx_lm.models.base.scaled_dot_product_attention`; trims go through
`trim_prompt_cache`. The driver only calls mlx-lm: it re-implements none of it and works around none of its bugs.
"""
import mlx.core as mx

from kvsim import kit

BASE, CACHE = kit.load_modules("mlx_lm", ["models.base", "models.cache"])


class MlxLm(kit.Driver):
    """mlx-lm's caches by the ids kvsim gives them."""

    name = "mlx-lm"
    supports = {"kv": True, "serial_trim": True, "rows_window": True, "rows_trim": True, "join": False,
                "rotating": True}

    def version(self):
        return kit.package_version("mlx-lm")

    def hello_extra(self):
        return {"mlx": kit.package_version("mlx")}

    def op_new(self, r):
        self.geometry = r["geometry"]
        w = self.geometry.get("max_size")
        self.handles[r["id"]] = CACHE.RotatingKVCache(max_size=w, keep=0) if w else CACHE.KVCache()
        return {}

    def op_window(self, r):
        c = self.handles[r["id"]]
        k, v, q = kit.arr_in(r["k"]), kit.arr_in(r["v"]), kit.arr_in(r["q"])
        # the mask of the cache before the write, as a model's forward builds it
        mask = BASE.create_attention_mask(q.transpose(0, 2, 1, 3), c, window_size=self.geometry.get("max_size"))
        keys, values = c.update_and_fetch(k, v)
        out = BASE.scaled_dot_product_attention(q, keys, values, c, scale=r["scale"], mask=mask)
        return {"out": kit.arr_out(out)}

    op_decode = op_rows_window = op_rows_decode = op_window

    def op_trim(self, r):
        return {"trimmed": CACHE.trim_prompt_cache([self.handles[r["id"]]], r["n"])}

    op_rows_trim = op_trim

    def state_of(self, c):
        """The K/V the next read attends, oldest first: the first `offset` columns of a KVCache; the newest
        min(offset, W) of a RotatingKVCache in temporal order (its `_temporal_order`)."""
        g = self.geometry
        if c.keys is None:
            empty = mx.zeros([1, g["heads_kv"], 0, g["head_dim"]], dtype=kit.mx_dtype(g["dtype"]))
            return {"k": kit.arr_out(empty), "v": kit.arr_out(empty)}
        w = g.get("max_size")
        if not w:
            return {"k": kit.arr_out(c.keys[..., : c.offset, :]), "v": kit.arr_out(c.values[..., : c.offset, :])}
        k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
        n = max(0, min(c.offset, w, k.shape[2]))
        return {"k": kit.arr_out(k[..., k.shape[2] - n :, :]), "v": kit.arr_out(v[..., v.shape[2] - n :, :])}

    def op_state(self, r):
        return self.state_of(self.handles[r["id"]])

    def op_offset(self, r):
        return {"offset": int(self.handles[r["id"]].offset)}

    def op_merge(self, r):
        rows = [self.handles.pop(i) for i in r["rows"]]
        self.handles[r["id"]] = rows[0].merge(rows)
        return {}

    def op_extend(self, r):
        self.handles[r["id"]].extend(self.handles.pop(r["other"]))
        return {}

    def op_rows_info(self, r):
        offsets = [int(o) for o in self.handles[r["id"]].offset.tolist()]
        return {"rows": len(offsets), "offsets": offsets}

    def op_extract(self, r):
        self.handles[r["new"]] = self.handles[r["id"]].extract(r["row"])
        return {}

    def op_filter(self, r):
        self.handles[r["id"]].filter(r["keep"])
        return {}

    def op_rows_state(self, r):
        return self.state_of(self.handles[r["id"]].extract(r["row"]))


if __name__ == "__main__":
    kit.serve(MlxLm)
