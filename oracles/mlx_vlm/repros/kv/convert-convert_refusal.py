#!/usr/bin/env python3
"""mlx-vlm 0.7.10: converting a cache that holds no position accepts quantization parameters MLX refuses.

`KVCache.to_quantized(group_size, bits)` (`mlx_vlm/models/cache.py:609-617`) quantizes its keys and values only `if
self.keys is not None`: a cache with positions refuses a group of 256 (or bits 1, 7, 16) through `mx.quantize`, an
empty one returns a `QuantizedKVCache` with those parameters, and the failure moves to that cache's first write. Written
by hand after kvsim check-engine's `--kv convert` run (`bench/results/check-engine-mlx-vlm/kv-convert.log`, class
`convert_refusal`, judged by kvsim's model: 15 of 500 seeds; shortest trace beside this script: admit a request, then
the conversion op at 8 bits in groups of 256 while it holds no position). Exits 1 and prints the first divergence
while it is there, 0 once it is gone. Imports only the standard library, mlx and mlx_vlm (its cache module, loaded
without the package `__init__`, which needs transformers).
"""
import importlib
import importlib.util
import os
import sys
import types

import mlx.core as mx


def load(package, sub):
    root = next(iter(importlib.util.find_spec(package).submodule_search_locations))
    name, path = package, root
    for part in [None] + sub.split(".")[:-1]:
        if part is not None:
            name, path = f"{name}.{part}", os.path.join(path, part)
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__, stub.__package__ = [path], name
            sys.modules[name] = stub
    return importlib.import_module(f"{package}.{sub}")


cache = load("mlx_vlm", "models.cache")
H, D, GROUP, BITS = 2, 128, 256, 8  # a group MLX's affine quantization does not take
k = mx.arange(H * D, dtype=mx.float32).reshape(1, H, 1, D).astype(mx.bfloat16) / 64

held = cache.KVCache()
held.update_and_fetch(k, k)
try:
    held.to_quantized(group_size=GROUP, bits=BITS)
    with_positions = "accepted"
except ValueError as e:
    with_positions = f"refused ({e})"

empty = cache.KVCache()
try:
    converted = empty.to_quantized(group_size=GROUP, bits=BITS)
except ValueError as e:
    print(f"no divergence: the empty cache refuses too ({e}); with a position: {with_positions}")
    sys.exit(0)
try:
    converted.update_and_fetch(k, k)
    first_write = "the first write passes"
except ValueError as e:
    first_write = f"its first write raises: {e}"
print(f"to_quantized(group_size={GROUP}, bits={BITS}): a KVCache with a position is {with_positions}; an empty one is "
      f"accepted as a {type(converted).__name__}(group_size={converted.group_size}, bits={converted.bits}), and "
      f"{first_write}")
sys.exit(1)
