#!/usr/bin/env python3
"""mlx-vlm 0.7.10: `ArraysCache.make_mask` of a right-padded batch of recurrent caches ignores the prompt lengths.

kvsim's class `rec_state` of `check-engine --only recurrent` on mlx-vlm 0.7.10, shortest trace one op: three new
requests prompted together as one right-padded batch, lengths [2, 3, 1]; afterwards the SSM array of the shorter
prompts' rows holds the state of a padding step (the conv windows are right: `update_window(..., lengths=...)`,
`models/cache.py:961-975`, takes each row's window at its length). Root cause, with the cache alone:

- `ArraysCache.merge` of caches that hold nothing yet gives the batch a left padding of zeros
  (`models/cache.py:1300-1303`);
- `prepare(lengths=...)` (:1271-1272) sets the lengths beside it;
- `make_mask` (:1284-1292) returns the left-padding mask whenever there is one and the lengths mask only when there
  is none, so every padding step passes it.

mlx-lm 0.32.2's `ArraysCache.make_mask` ands the two masks; mlx-lm 0.31.3 has the same failure
(`oracles/vllm_mlx/repros/recurrent/by-hand/`). Exits 1 and prints the mask while the bug is there.
"""
import importlib
import importlib.util
import os
import sys
import types

import mlx.core as mx


def load(package, sub):
    """`package.sub` without the package's `__init__` (mlx-vlm's imports its model-loading stack)."""
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


ArraysCache = load("mlx_vlm", "models.cache").ArraysCache
lengths, longest = [3, 1], 3
want = [[True, True, True], [True, False, False]]
batch = ArraysCache.merge([ArraysCache(2), ArraysCache(2)])
batch.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])
mask = batch.make_mask(longest)
got = mx.broadcast_to(mask, (len(lengths), longest)).tolist() if mask is not None else None
if got != want:
    print(f"ArraysCache.merge of two empty caches, prepare(lengths={lengths}): make_mask({longest}) = {got}, "
          f"want {want}: the padding steps of the shorter prompt reach its state")
    sys.exit(1)
print(f"ArraysCache.merge: make_mask({longest}) = {got}, as the prompt lengths say")
