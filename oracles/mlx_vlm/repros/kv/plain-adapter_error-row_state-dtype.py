#!/usr/bin/env python3
"""mlx-vlm 0.7.10: a bf16 batch extended with a batch of rows that hold no position becomes f32.

`BatchKVCache.extend` and `BatchRotatingKVCache.extend` (`mlx_vlm/models/cache.py:1707-1710`, :2061-2064) stand in
`mx.array([]).reshape(B, H, 0, D)` for the side whose `keys` is None: an empty array of MLX's default float32, which
`mx.concatenate` promotes the other side's bf16 keys and values to; every later write is cast up and every read of
the batch answers f32. Written by hand (the scripts beside it are kvsim check-engine's) after the `--kv plain` run:
its class `adapter_error/row_state` ("the cache's k is f32 in a bf16 run", raised by the driver's dtype check) is
found once the empty-batch extract of `plain-adapter_error-row_state.py` no longer stops the runs first (168 of 500
seeds). Shortest trace beside this script (W = 5, bf16): admit 1 and 2, a prefill of request 1's one position, join
of request 2 before its first position. The script makes the same kind of calls with mlx-vlm alone: a batch of one
bf16 row, extended with the batch a request of no position merges into. Exits 1 and prints the first divergence while
it is there, 0 once it is gone. Imports only the standard library, mlx and mlx_vlm (its cache module, loaded without
the package `__init__`, which needs transformers).
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
H, D = 2, 16
problems = []
for name, new in (("KVCache", cache.KVCache), ("RotatingKVCache", lambda: cache.RotatingKVCache(max_size=5, keep=0))):
    running = new()
    k = mx.arange(3 * H * D, dtype=mx.float32).reshape(1, H, 3, D).astype(mx.bfloat16) / 64
    running.update_and_fetch(k, k)
    running = running.merge([running])  # the running batch: one row of 3 bf16 positions
    joining = new().merge([new()])  # a request that has no position yet, as its own batch
    running.extend(joining)  # the batch now has two rows
    if running.keys.dtype != mx.bfloat16:
        problems.append(f"{type(running).__name__}.extend: the batch's keys were bfloat16, after extending with a "
                        f"batch of no position they are {running.keys.dtype} (values {running.values.dtype}); "
                        f"row 0 read back: {running.extract(0).keys.dtype}")
if problems:
    print("\n".join(problems))
    sys.exit(1)
print("no divergence: the batches keep bfloat16")
sys.exit(0)
