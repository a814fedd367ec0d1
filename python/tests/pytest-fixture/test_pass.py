"""The kvsim_check fixture passing: mlx-lm 0.32.2 with its three known upstream classes pinned (docs/engines.md).

As an engine's own test suite would hold it; python/test-wheel.sh runs it from the installed wheel (docs/python.md).
"""
MLX_LM_KNOWN = {"adapter_error/row_state", "rows_vs_solo", "rows_trim_vs_solo"}


def test_mlx_lm_matches_solo_but_known_classes(kvsim_check):
    summary = kvsim_check(driver="python -m kvsim.drivers.mlx_lm", seeds=50, known=MLX_LM_KNOWN)
    assert summary["engine"] == "mlx-lm" and summary["unexpected"] == []
