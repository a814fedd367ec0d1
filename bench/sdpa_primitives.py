"""MLX primitives one CPU SDPA decode read costs: run under
`perf stat -e probe_libmlx:<probe on mlx::core::cpu::eval(array&)>` with N = 0 and N = 1000 and take the difference / N.
Usage: python bench/sdpa_primitives.py f32|bf16 N [causal]   (the simulator bench's shapes: H_q 4, H_kv 2, D 16, 8 keys)
"""
import mlx.core as mx, sys
mx.set_default_device(mx.cpu)
B, hq, hkv, D, S = 1, 4, 2, 16, 8
dt = mx.float32 if sys.argv[1] == "f32" else mx.bfloat16
q = mx.random.normal((B, hq, 1, D)).astype(dt); k = mx.random.normal((B, hkv, S, D)).astype(dt); v = mx.random.normal((B, hkv, S, D)).astype(dt)
mx.eval(q, k, v)
n = int(sys.argv[2])
for i in range(n):
    o = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=None if len(sys.argv) < 4 else "causal")
    mx.eval(o)
