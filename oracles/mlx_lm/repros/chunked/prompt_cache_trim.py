#!/usr/bin/env python3
"""mlx-lm 0.32.2: a ChunkedKVCache trimmed past the front it dropped comes back at another offset than asked.

`ChunkedKVCache.is_trimmable` is always True (`mlx_lm/models/cache.py:785-786`), but `trim(n)` can only give back the
positions the cache still holds: it drops `min(offset - start_position, n)` (:788-791), and the positions that
`maybe_trim_front` dropped (:737-746, called by llama4's forward before its layers write, `models/llama4.py:228-231`)
are gone for good. `LRUPromptCache.fetch_nearest_cache` (:1652-1666) trims a longer stored entry to the common prefix
through `trim_prompt_cache`, ignores the count it returns, and hands back the rest of the prompt as if the cache now
held exactly the prefix. A llama4 layer whose front was dropped then comes back with an offset beyond the prefix (the
next token is written, and RoPE'd by `cache.offset`, at the wrong position) and without the positions of its chunk that
the next read attends. Written by hand after the `--kv chunked` run, whose `trim_count` class (a trim kvsim's ring
model refuses once the window has filled) is where this hazard lives; kvsim cannot restate that class in a script.

The calls (chunk size 4, one layer, the cache filled as llama4's forward fills it: `maybe_trim_front()`, then
`update_and_fetch`): a prompt of 8 tokens in one forward, two decodes (tokens 9 and 10), the 10-token sequence stored
with `insert_cache`; then prompts that share its first 6 and its first 3 tokens are looked up (each gets its own
deep copy, trimmed by 4 and by 7). Exits 1 and prints the divergence
while it is there, 0 once it is gone. Imports only the standard library, mlx and mlx_lm (its cache module, loaded
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


cache = load("mlx_lm", "models.cache")
C, H, D = 4, 1, 8


def forward(c, first, n):
    """One llama4 forward of positions first..first+n-1 on a chunked layer (values: the position numbers)."""
    c.maybe_trim_front()
    k = mx.broadcast_to(mx.arange(first, first + n, dtype=mx.float32)[None, None, :, None], (1, H, n, D))
    c.update_and_fetch(k, k)


layer = cache.ChunkedKVCache(chunk_size=C)
forward(layer, 0, 8)  # the prompt: positions 0-7
forward(layer, 8, 1)  # decode: the front drops to the newest 4 (4-7), then position 8
forward(layer, 9, 1)  # decode: the front drops to 5-8, then position 9
stored = list(range(100, 110))  # the 10 tokens of positions 0-9
lru = cache.LRUPromptCache()
lru.insert_cache("m", stored, [layer])

problems = []
for shared in (6, 3):  # a prompt that shares the stored sequence's first `shared` tokens, then differs
    prompt = stored[:shared] + [7, 7, 7]
    caches, rest = lru.fetch_nearest_cache("m", prompt)
    if caches is None:
        problems.append(f"sharing {shared}: the lookup missed")
        continue
    c = caches[0]
    matched = len(prompt) - len(rest)
    held = c.offset - c.start_position
    keys = [int(x) for x in c.keys_and_values()[0][0, 0, :, 0].tolist()] if held > 0 else []
    if c.offset != matched:
        problems.append(f"sharing {shared}: fetch_nearest_cache hands back the prompt from token {matched} on, but "
                        f"the chunked layer's offset is {c.offset}: the next token goes to position {c.offset}, not "
                        f"{matched}")
    first = (matched // C) * C  # the first position of the chunk the next token (position `matched`) attends
    need = list(range(first, matched))
    if [q for q in need if q not in keys]:
        problems.append(f"sharing {shared}: the next token (position {matched}) attends positions {need} of its "
                        f"chunk; the layer holds {keys} (start_position {c.start_position})")
for p in problems:
    print(p)
if problems:
    sys.exit(1)
print("no divergence: the trimmed chunked layer holds the prefix it was trimmed to")
sys.exit(0)
