#!/usr/bin/env python3
"""mlx-lm 0.31.3 (the mlx-lm vllm-mlx 0.6.0 declares): a right-padded prompt batch of recurrent caches is not masked.

kvsim's class `rec_state` of `check-engine --only recurrent` on vllm-mlx 0.6.0 (both `--rec mamba` and
`--rec arrays`), shortest trace one op: three new requests prompted together as one right-padded batch, lengths
[2, 3, 1]; afterwards the rows of the shorter prompts hold the state of a padding step. Root cause, restated here
with the caches alone:

- a batch of requests that hold no state yet is made by `merge`, which gives it a left padding of zeros:
  `ArraysCache.merge` (mlx-lm 0.31.3 `models/cache.py:707-710`) and vllm-mlx's `BatchMambaCache.merge`
  (`vllm_mlx/utils/mamba_cache.py:83`);
- `BatchGenerator.prompt` (mlx-lm 0.31.3 `generate.py:1150-1153`) then calls `prepare(lengths=..., right_padding=...)`;
- `make_mask` (`models/cache.py:691-699`) returns the left-padding mask whenever there is one, and the `lengths` mask
  only when there is none: every padding step passes the mask, and a recurrent layer writes it into the row's state.

mlx-lm 0.32.2 combines the two masks (`make_mask`, `models/cache.py:687-696`): this script exits 0 there. The same
failure in the Swift port: ml-explore/mlx-swift-lm#264. Exits 1 and prints the masks while the bug is there.
"""
import importlib
import importlib.util
import os
import sys
import types

import mlx.core as mx


def load(package, sub):
    """`package.sub` without the package's `__init__` (mlx-lm's imports the model-loading stack)."""
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


ArraysCache = load("mlx_lm", "models.cache").ArraysCache
lengths, longest = [3, 1], 3
want = [[True, True, True], [True, False, False]]
batches = [("ArraysCache.merge", lambda: ArraysCache.merge([ArraysCache(2), ArraysCache(2)]))]
if importlib.util.find_spec("vllm_mlx") is not None:
    BatchMambaCache = load("vllm_mlx", "utils.mamba_cache").BatchMambaCache
    batches.append(("BatchMambaCache.merge", lambda: BatchMambaCache.merge([ArraysCache(2), ArraysCache(2)])))
failed = False
for name, make in batches:
    batch = make()
    batch.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])
    mask = batch.make_mask(longest)
    got = mx.broadcast_to(mask, (len(lengths), longest)).tolist() if mask is not None else None
    if got != want:
        failed = True
        print(f"{name} of two empty caches, prepare(lengths={lengths}): make_mask({longest}) = {got}, want {want}: "
              f"the padding steps of the shorter prompt reach its state")
    else:
        print(f"{name}: make_mask({longest}) = {got}, as the prompt lengths say")
sys.exit(1 if failed else 0)
