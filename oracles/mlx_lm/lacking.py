"""The two cache classes mlx-lm 0.32.2 lacks, built from its pieces for the oracle driver (../PROTOCOL.md decisions
15 and 16): `RotatingQuantizedKVCache` (mlx-lm's RotatingKVCache over `mx.quantize` triples; only the array ops that
must act on triples are redone) and `RowCaches` (a quantized batch mapped onto each row's own solo caches), with the
triple type they hold (`Planes`) and `relayout` (a solo ring laid out as mlx-lm lays out a batch row after a layout
event). Imported by driver.py after it has registered its stand-ins for the `mlx_lm` packages, so that
`mlx_lm.models.cache` is the one module of mlx-lm this file reads."""
import mlx.core as mx
from mlx_lm.models import cache as CACHE


class Planes(tuple):
    """An affine triple `(packed uint32, scales, biases)` as `mx.quantize` returns it, with the `shape` of its packed
    plane: the one attribute of an array that mlx-lm's RotatingKVCache code reads from its buffers besides the
    array ops (`shape[2]`, the column count, is the same in the three planes)."""

    @property
    def shape(self):
        return self[0].shape


def quantize_planes(x, group_size, bits):
    return Planes(mx.quantize(x, group_size=group_size, bits=bits))


def relayout(c, how):
    """A solo ring's layout after a batch layout event, as mlx-lm lays the row out (decision 16): `merge` keeps the
    temporal tail of `size()` positions with the write head at its end (`BatchRotatingKVCache.merge`:
    `c._temporal_order(c.keys)[..., -l:, :]`, then `extract` of that row), `extract` the row de-rolled to temporal
    order (`BatchRotatingKVCache.extract`: `_idx` = the buffer length). kvsim's rows do the same (docs/requirements.md
    R-BROT-4, R-BROT-5); `join` keeps the phase (R-BROT-7) and changes nothing. A linear cache keeps its columns."""
    if not isinstance(c, CACHE.RotatingKVCache) or c.keys is None:
        return
    quant = isinstance(c, RotatingQuantizedKVCache)

    def cut(v, n):
        return Planes(x[..., x.shape[2] - n:, :] for x in v) if quant else v[..., v.shape[2] - n:, :]

    k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
    if how == "merge":
        n = c.size()
        k, v = cut(k, n), cut(v, n)
    c.keys, c.values = k, v
    c._idx = k.shape[2]


class RotatingQuantizedKVCache(CACHE.RotatingKVCache):
    """A rotating cache over affine triples (PROTOCOL.md decision 15). mlx-lm 0.32.2 has none
    (`RotatingKVCache.to_quantized` raises NotImplementedError("RotatingKVCache Quantization NYI")); this is
    `RotatingKVCache` (keep, `_idx`, `offset`, `max_size`, `step`; in-place writes for L = 1, concatenation in
    temporal order keeping `max_size - 1` columns otherwise; its `make_mask`, `trim`, `is_trimmable`, `size`,
    `_update_concat` run unchanged) whose buffers are `(packed, scales, biases)` triples made by `mx.quantize` as
    `QuantizedKVCache.update_and_fetch` makes them, read by `base.quantized_scaled_dot_product_attention` (the
    dispatch of `base.scaled_dot_product_attention` on `cache.bits`). Only the array ops of `RotatingKVCache` that
    must act on triples are redone plane by plane: `_trim`, `_temporal_order` (the parent's, per plane),
    `_update_in_place` (the parent's lines, with every array op per plane; new columns are zeros of each plane's
    width and dtype, as `QuantizedKVCache`'s `expand_quant`, so no `D // (32 // bits)` width) and
    `keys_and_values`. `from_ring` converts a plain ring as the upstream engine's RotatingQuantizedKVCache (and
    kvsim) do: the buffer quantized as laid out (physical order, every allocated column), offset and `_idx` kept."""

    def __init__(self, max_size, keep=0, group_size=64, bits=8):
        super().__init__(max_size, keep)
        self.group_size = group_size
        self.bits = bits

    @classmethod
    def from_ring(cls, ring, group_size, bits):
        q = cls(ring.max_size, ring.keep, group_size=group_size, bits=bits)
        q.offset, q._idx = ring.offset, ring._idx
        if ring.keys is not None:
            q.keys = quantize_planes(ring.keys, group_size, bits)
            q.values = quantize_planes(ring.values, group_size, bits)
        return q

    def _trim(self, trim_size, v, append=None):
        parent = super()._trim
        return Planes(parent(trim_size, x, None if append is None else a)
                      for x, a in zip(v, append if append is not None else (None,) * len(v)))

    def _temporal_order(self, v):
        parent = super()._temporal_order
        return Planes(parent(x) for x in v)

    def _update_in_place(self, keys, values):
        # RotatingKVCache._update_in_place, line for line, with the array ops per plane
        B, n_kv_heads, S, _ = keys.shape
        prev = self.offset
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            new_size = min(self.step, self.max_size - prev)

            def zeros(t):
                return Planes(mx.zeros((B, n_kv_heads, new_size, x.shape[-1]), dtype=x.dtype) for x in t)

            new_k, new_v = zeros(keys), zeros(values)
            if self.keys is not None:
                self.keys = Planes(mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, new_k))
                self.values = Planes(mx.concatenate([a, b], axis=2) for a, b in zip(self.values, new_v))
            else:
                self.keys, self.values = new_k, new_v
            self._idx = prev

        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self._trim(trim_size, self.keys)
            self.values = self._trim(trim_size, self.values)
            self._idx = self.max_size

        if self._idx == self.max_size:
            self._idx = self.keep

        for i in range(len(self.keys)):
            self.keys[i][..., self._idx: self._idx + S, :] = keys[i]
            self.values[i][..., self._idx: self._idx + S, :] = values[i]
        self.offset += S
        self._idx += S
        return self.keys_and_values()

    def update_and_fetch(self, keys, values):
        # quantized per incoming block, as QuantizedKVCache.update_and_fetch; then RotatingKVCache's dispatch
        return super().update_and_fetch(quantize_planes(keys, self.group_size, self.bits),
                                        quantize_planes(values, self.group_size, self.bits))

    def keys_and_values(self):
        if self.offset < self.keys.shape[2]:
            return (tuple(x[..., : self.offset, :] for x in self.keys),
                    tuple(x[..., : self.offset, :] for x in self.values))
        return tuple(self.keys), tuple(self.values)

    def to_quantized(self, group_size=64, bits=4):
        raise NotImplementedError("already quantized")


class RowCaches:
    """kvsim's quantized batch mapped row by row (PROTOCOL.md decision 16): each row is its request's own solo
    caches (one per layer: QuantizedKVCache or RotatingQuantizedKVCache), written and read alone with the row's
    real positions and queries. mlx-lm 0.32.2 has no batched quantized cache; this checks kvsim's promise that
    each batch row equals its solo run, against mlx-lm's solo computation."""

    def __init__(self, rows):
        self.rows = [list(r) for r in rows]
