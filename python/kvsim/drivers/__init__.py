"""Engine drivers, one module per engine: `python -m kvsim.drivers.<engine>` under that engine's venv.

- `mlx_lm`: mlx-lm's K/V caches (protocol-1 requests).
- `vllm_mlx`: vllm-mlx's `PagedCacheManager` (protocol-2 block-pool requests).
"""
