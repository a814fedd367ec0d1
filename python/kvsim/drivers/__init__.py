"""Engine drivers, one module per engine: `python -m kvsim.drivers.<engine>` under that engine's venv.

- `mlx_lm`: mlx-lm's K/V caches (protocol-1 requests) and its `LRUPromptCache` (prefix requests).
- `vllm_mlx`: vllm-mlx's `PagedCacheManager` (block-pool requests) and its `MemoryAwarePrefixCache` /
  `BlockAwarePrefixCache` (prefix requests).
- `mlx_vlm`: mlx-vlm's `APCManager` exact-prefix checkpoints (prefix requests).
"""
