"""The kvsim_check fixture on an engine that breaks (python/test-wheel.sh expects both tests to fail): a driver that
exits before its handshake (check-engine's exit 2, reported as "the engine broke"), and a check past `time_limit`.
"""


def test_engine_exits_before_hello(kvsim_check):
    kvsim_check(driver="python -c 'import sys; sys.exit(3)'", seeds=2)


def test_past_time_limit(kvsim_check):
    kvsim_check(driver="python -m kvsim.drivers.mlx_lm", seeds=500, time_limit=1)
