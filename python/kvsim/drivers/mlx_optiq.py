"""kvsim's quantized K/V requests served by mlx-optiq's own caches (oracles/mlx_optiq/README.md).

    PYTHONPATH=python oracles/mlx_optiq/.venv/bin/python -m kvsim.drivers.mlx_optiq \
        [--cache batch|rotating] [--plant quant-row-copy]

Every run is quantized (`supports.quant_only`): `new` carries `quant` (`bits`, `group_size`). A full-attention
serial cache is optiq's `MergeableQuantizedKVCache(group_size, bits)` (`optiq/runtime/kv/batch.py`), whose `merge` is
`BatchQuantizedKVCache.merge`; a batch is that `BatchQuantizedKVCache` (grown by `extend`, shrunk by `extract`,
`filter`, trimmed by `trim_prompt_cache`, readied for a right-padded prefill by `prepare` and ended by its own
`finalize`). `--cache rotating` adds sliding windows: a serial cache is then optiq's
`RotatingQuantizedKVCache(max_size=W, keep=0, group_size, bits)` (`optiq/runtime/kv/rotating.py`), and runs stay
serial (`supports.quant_rows` false), and half of them start plain (mlx-lm's `KVCache` / `RotatingKVCache`) until
kvsim's conversion op, served by optiq's `quantize_cache_layer(c, bits, group_size)` (`rotating.py:658`: a ring
becomes a `RotatingQuantizedKVCache` keeping its `_idx`); optiq quantizes the batch path's full-attention layers only and leaves
sliding-window layers at full precision (`install_batch_kv_quant`, `batch.py:420-437`). The driver first installs what
`optiq serve` installs (`patch_rotating_to_quantized()`: optiq's SDPA dispatch and its GQA mask fix;
`batch_rotating_merge.install()`). Reads take their mask
from the cache before the write (`create_attention_mask`) and attend through `mlx_lm.models.base`'s
`scaled_dot_product_attention` (its quantized path: the caches have `bits`). States are the planes of the positions
the next read attends, in temporal order (`kit.state_reply`).

`--plant quant-row-copy` (a negative control, hello's `version` says `+plant:...`): after every decode of a batch of
two rows or more, row 1's newest K column takes row 0's packed words (a quantized row written at another row's
column). `--plant convert-phase` (with `--cache rotating`): a wrapped ring converted without its write position.
"""
from kvsim import kit

BASE, CACHE = kit.load_modules("mlx_lm", ["models.base", "models.cache"])
ROT, BATCH, ROT_MERGE = kit.load_modules(
    "optiq", ["runtime.kv.rotating", "runtime.kv.batch", "runtime.kv.batch_rotating_merge"])
ROT.patch_rotating_to_quantized()
ROT_MERGE.install()


class MlxOptiq(kit.BatchCalls, kit.Driver):
    """mlx-optiq's quantized caches by the ids kvsim gives them."""

    name = "mlx-optiq"
    supports = {"kv": True, "quant_only": True, "quant_rows": True, "serial_trim": True, "rows_window": True,
                "rows_trim": True, "join": False, "rotating": False, "prefill": True}
    options = {"plant": (None, "quant-row-copy", "convert-phase"), "cache": ("batch", "rotating")}

    def __init__(self, **opts):
        super().__init__(**opts)
        if self.opts["cache"] == "rotating":
            # half the runs quantized from the first write, the other half plain (mlx-lm's KVCache /
            # RotatingKVCache) until kvsim's conversion op, served by optiq's `quantize_cache_layer`
            self.supports = dict(self.supports, rotating=True, quant_rows=False, quant_only=False, quant=True,
                                 convert=True, prefill=False)

    def version(self):
        v = kit.package_version("mlx-optiq") + (" rotating" if self.opts["cache"] == "rotating" else "")
        return v + (f"+plant:{self.opts['plant']}" if self.opts["plant"] else "")

    def hello_extra(self):
        return {"mlx": kit.package_version("mlx"), "mlx-lm": kit.package_version("mlx-lm")}

    def op_new(self, r):
        self.geometry = g = r["geometry"]
        q, w = g.get("quant"), g.get("max_size")
        if not q:
            c = CACHE.RotatingKVCache(max_size=w, keep=0) if w else CACHE.KVCache()
        elif w:
            c = ROT.RotatingQuantizedKVCache(max_size=w, keep=0, group_size=q["group_size"], bits=q["bits"])
        else:
            c = BATCH.MergeableQuantizedKVCache(group_size=q["group_size"], bits=q["bits"])
        self.handles[r["id"]] = c
        return {}

    def op_window(self, r):
        c = self.handles[r["id"]]
        k, v, q = kit.arr_in(r["k"]), kit.arr_in(r["v"]), kit.arr_in(r["q"])
        mask = BASE.create_attention_mask(q.transpose(0, 2, 1, 3), c, window_size=self.geometry.get("max_size"))
        keys, values = c.update_and_fetch(k, v)
        out = BASE.scaled_dot_product_attention(q, keys, values, c, scale=r["scale"], mask=mask)
        return {"out": kit.arr_out(out)}

    op_decode = op_rows_window = op_window

    def op_rows_decode(self, r):
        out = self.op_window(r)
        c = self.handles[r["id"]]
        if self.opts["plant"] == "quant-row-copy" and c.keys[0].shape[0] >= 2:
            col = int(c._idx) - 1
            c.keys[0][1, :, col, :] = c.keys[0][0, :, col, :]
        return out

    def op_convert(self, r):
        q = r["quant"]
        c = self.handles[r["id"]] = ROT.quantize_cache_layer(self.handles[r["id"]], q["bits"], q["group_size"])
        if self.opts["plant"] == "convert-phase" and hasattr(c, "_idx") and c.offset > c.max_size:
            c._idx = 0  # the planted bug: a wrapped ring converted without its write position
        self.geometry = dict(self.geometry, quant=q)  # kvsim converts every cache of the run at once
        return {}

    def op_trim(self, r):
        return {"trimmed": CACHE.trim_prompt_cache([self.handles[r["id"]]], r["n"])}

    op_rows_trim = op_trim

    def op_state(self, r):
        return kit.state_reply(self.handles[r["id"]], self.geometry)

    def op_offset(self, r):
        return {"offset": int(self.handles[r["id"]].offset)}

    def op_merge(self, r):
        rows = [self.handles.pop(i) for i in r["rows"]]
        self.handles[r["id"]] = rows[0].merge(rows)
        return {}


if __name__ == "__main__":
    kit.serve(MlxOptiq)
