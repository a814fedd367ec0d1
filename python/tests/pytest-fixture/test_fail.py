"""The kvsim_check fixture failing (python/test-wheel.sh expects both tests to fail):

- vllm-mlx 0.6.0's driver with the planted `cow-keeps-shared` (a copy-on-write that copies nothing), the manager's
  other two classes pinned: the test fails on `pool_cow`. (The stock manager fails `pool_cow` too, on fewer seeds:
  a real finding, docs/engines.md; so the passing side is mlx-lm with its known classes, test_pass.py.)
- mlx-lm 0.32.2 with nothing pinned: its three upstream classes fail the test.
"""


def test_vllm_mlx_planted_cow_bug(kvsim_check):
    kvsim_check(driver="python -m kvsim.drivers.vllm_mlx --plant cow-keeps-shared", seeds=200,
                known={"pool_lookup", "pool_storage"})


def test_mlx_lm_nothing_pinned(kvsim_check):
    kvsim_check(driver="python -m kvsim.drivers.mlx_lm", seeds=50)
