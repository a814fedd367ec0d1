"""kvsim's Python side: the driver kit (`kvsim.kit`, `kvsim.poolcheck`) and the engine drivers (`kvsim.drivers`).

`kvsim check-engine --driver "python -m kvsim.drivers.<engine>"` drives an engine's caches over kvsim's engine
protocol (oracles/PROTOCOL.md); a driver is a small module built on `kvsim.kit`.
"""
