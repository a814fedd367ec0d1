"""Tests of the prefix-cache requests (`supports.prefix`): the kit's prefix checker on a driver without an engine,
and the engines' prefix caches through their drivers where their venvs are installed.

    PYTHONPATH=python python3 -m unittest discover -s python/tests                                 # the checker
    PYTHONPATH=python oracles/mlx_lm/.venv/bin/python -m unittest discover -s python/tests         # + LRUPromptCache
    PYTHONPATH=python oracles/vllm_mlx/.venv/bin/python -m unittest discover -s python/tests       # + vllm-mlx's
    PYTHONPATH=python oracles/mlx_vlm/.venv/bin/python -m unittest discover -s python/tests        # + mlx-vlm's APC

K/V are made the way kvsim makes them for prefix caches: position p's K and V a pure function of tokens[:p+1], the
layer and the element, so the same prefix has the same bytes in every call.
"""
import base64
import hashlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

from kvsim import kit, prefixcheck

H, D = 2, 4


def kv(tokens, layer, which):
    vals = []
    for h in range(H):
        for p in range(len(tokens)):
            seed = hashlib.sha256(json.dumps([tokens[: p + 1], layer, which, h]).encode()).digest()
            vals += [struct.unpack("<I", seed[4 * d : 4 * d + 4])[0] / 2**32 - 0.5 for d in range(D)]
    return {"dtype": "f32", "shape": [1, H, len(tokens), D],
            "b64": base64.b64encode(struct.pack("<%df" % len(vals), *vals)).decode()}


def new(windows, bs=2, pid=1):
    return {"op": "prefix_new", "id": pid, "layers": [{"max_size": w} for w in windows], "heads_kv": H,
            "head_dim": D, "dtype": "f32", "block_size": bs}


def insert(windows, tokens, pid=1):
    return {"op": "prefix_insert", "id": pid, "tokens": tokens, "k": [kv(tokens, j, "k") for j in range(len(windows))],
            "v": [kv(tokens, j, "v") for j in range(len(windows))]}


def lookup(tokens, pid=1):
    return {"op": "prefix_lookup", "id": pid, "tokens": tokens}


EVICT = {"op": "prefix_evict", "id": 1}


def run_script(script):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "repro.py")
        with open(path, "w") as f:
            f.write(script)
        p = subprocess.run([sys.executable, "-I", path], capture_output=True, text=True, cwd=d)
        return p.returncode, p.stdout + p.stderr


class Echo(kit.Driver):
    """A prefix cache without an engine: it keeps the K/V inserted and answers a lookup with the longest inserted
    sequence sharing a prefix, cut to the common prefix (`--plant` bends one answer per check)."""

    name = "echo"
    supports = {"kv": False, "prefix": True}
    options = {"plant": (None, "count", "offset", "bytes")}

    def op_prefix_new(self, r):
        self.handles[r["id"]] = {"windows": [l["max_size"] for l in r["layers"]], "seqs": []}
        return {}

    def op_prefix_insert(self, r):
        self.handles[r["id"]]["seqs"].append((r["tokens"], r["k"], r["v"]))
        return {}

    def view(self, w, k, v, m):
        n = min(m, w) if w else m
        cut = lambda a: prefixcheck.first_positions(a, m)  # noqa: E731
        k, v = cut(k), cut(v)
        if n < m:  # the newest n of m positions
            raw = lambda a: base64.b64decode(a["b64"])  # noqa: E731
            row = D * 4
            pick = lambda a: {"dtype": "f32", "shape": [1, H, n, D], "b64": base64.b64encode(b"".join(  # noqa: E731
                raw(a)[(h * m + m - n) * row : (h * m + m) * row] for h in range(H))).decode()}
            k, v = pick(k), pick(v)
        return {"offset": m, "k": k, "v": v}

    def op_prefix_lookup(self, r):
        p, t = self.handles[r["id"]], r["tokens"]
        best = max(p["seqs"], key=lambda s: next((i for i, (a, b) in enumerate(zip(s[0], t)) if a != b),
                                                 min(len(s[0]), len(t))), default=None)
        m = 0 if best is None else next((i for i, (a, b) in enumerate(zip(best[0], t)) if a != b),
                                        min(len(best[0]), len(t)))
        if m == 0:
            return {"matched": 0, "states": None}
        states = [self.view(w, k, v, m) for w, k, v in zip(p["windows"], best[1], best[2])]
        plant = self.opts["plant"]
        if plant == "count":
            return {"matched": m + 1, "states": states}
        if plant == "offset":
            states[0]["offset"] = m - 1
        if plant == "bytes":
            other = self.view(None, *kv_pair([9] * m), m)
            states[0]["k"] = other["k"]
        return {"matched": m, "states": states}

    def op_prefix_cold(self, r):
        p = self.handles[r["id"]]
        m = len(r["tokens"])
        return {"states": [self.view(w, k, v, m) for w, k, v in zip(p["windows"], r["k"], r["v"])]}

    def op_prefix_evict(self, r):
        return {"evicted": 0}


def kv_pair(tokens):
    return kv(tokens, 0, "k"), kv(tokens, 0, "v")


class Checker(unittest.TestCase):
    CALLS = [new([None, 2]), insert([None, 2], [1, 2, 3, 4]), lookup([1, 2, 3, 9]), lookup([5])]

    def test_a_faithful_cache_passes_every_check(self):
        self.assertIsNone(kit.replay(Echo(), self.CALLS, "prefix"))

    def test_each_check_catches_its_plant(self):
        self.assertIn("[prefix_count]", kit.replay(Echo(plant="count"), self.CALLS, "prefix_count"))
        self.assertIn("[prefix_offset] layer 0 was restored at offset 2, matched says 3",
                      kit.replay(Echo(plant="offset"), self.CALLS, "prefix_offset"))
        self.assertIn("[prefix_model] layer 0 K", kit.replay(Echo(plant="bytes"), self.CALLS, "prefix_model"))
        self.assertIn("[prefix_warm_cold] layer 0 K", kit.replay(Echo(plant="bytes"), self.CALLS, "prefix_warm_cold"))
        self.assertIsNone(kit.replay(Echo(plant="bytes"), self.CALLS, "prefix_offset"))

    def test_first_positions(self):
        a = kv([1, 2, 3], 0, "k")
        self.assertEqual(prefixcheck.first_positions(a, 2), kv([1, 2], 0, "k"))
        self.assertEqual(prefixcheck.first_positions(a, 0)["shape"], [1, H, 0, D])

    def test_reproducer_is_standalone_and_exits_1(self):
        calls = [{"op": "reset"}] + self.CALLS
        s = kit.Server(Echo(plant="offset")).handle({"op": "reproducer", "calls": calls, "divergence": "prefix_offset"})
        rc, out = run_script(s["script"])
        self.assertEqual(rc, 1, out)
        self.assertIn("[prefix_offset]", out)
        s = kit.Server(Echo()).handle({"op": "reproducer", "calls": calls, "divergence": "prefix_offset"})
        self.assertEqual(run_script(s["script"])[0], 0)


def _has_lru_prompt_cache():
    if importlib.util.find_spec("mlx_lm") is None:
        return False
    from importlib import metadata

    return metadata.version("mlx-lm").startswith("0.32")


@unittest.skipUnless(_has_lru_prompt_cache(), "mlx-lm 0.32 (LRUPromptCache) is not installed")
class MlxLmPrefix(unittest.TestCase):
    def replay(self, calls, divergence="prefix", **opts):
        from kvsim.drivers.mlx_lm import MlxLm

        return kit.replay(MlxLm(**opts), calls, divergence)

    def test_shared_prefixes_pass_and_a_shorter_lookup_keeps_one_token(self):
        w = [None, 8]
        calls = [new(w), insert(w, [1, 2, 3, 4, 5]), insert(w, [1, 2, 3, 9]), lookup([1, 2, 3]), lookup([1, 2, 7]),
                 lookup([1, 2, 3, 4, 5, 6])]
        self.assertIsNone(self.replay(calls))
        from kvsim.drivers.mlx_lm import MlxLm

        s = kit.Server(MlxLm())
        for c in calls[:3]:
            s.handle(c)
        self.assertEqual(s.handle(lookup([1, 2, 3]))["matched"], 2)  # fetch_nearest_cache: min(len - 1, common)

    def test_past_the_window_a_shorter_prefix_misses_and_insert_after_evict(self):
        w = [None, 4]
        calls = [new(w), insert(w, [1, 2, 3, 4, 5, 6]), lookup([1, 2, 3]), EVICT, insert(w, [1, 2, 3, 4, 5, 6]),
                 lookup([1, 2, 3, 4, 5, 6, 7])]
        self.assertIsNone(self.replay(calls))
        from kvsim.drivers.mlx_lm import MlxLm

        s = kit.Server(MlxLm())
        replies = [s.handle(c) for c in calls]
        self.assertEqual((replies[2]["matched"], replies[3]["evicted"], replies[5]["matched"]), (0, 1, 6))

    def test_planted_short_restore_is_caught(self):
        w = [None, 8]
        calls = [new(w), insert(w, [1, 2, 3]), lookup([1, 2, 3])]
        self.assertIn("[prefix_offset] layer 0 was restored at offset 2, matched says 3",
                      self.replay(calls, plant="prefix-short"))
        from kvsim.drivers.mlx_lm import MlxLm

        version = kit.Server(MlxLm(plant="prefix-short")).handle({"op": "hello"})["version"]
        self.assertTrue(version.endswith("+plant:prefix-short"), version)

    def test_hello_protocol_2_keeps_the_kv_requests(self):
        from kvsim.drivers.mlx_lm import MlxLm

        h = kit.Server(MlxLm()).handle({"op": "hello"})
        self.assertEqual((h["protocol"], h["supports"]["kv"], h["supports"]["prefix"]), (2, True, True))


@unittest.skipUnless(importlib.util.find_spec("vllm_mlx") is not None, "vllm-mlx is not installed")
class VllmMlxPrefix(unittest.TestCase):
    def replay(self, calls, divergence="prefix", **opts):
        from kvsim.drivers.vllm_mlx import VllmMlx

        return kit.replay(VllmMlx(**opts), calls, divergence)

    def test_memory_cache_passes_shared_prefixes_trims_and_the_window_guard(self):
        w = [None, 4]
        calls = [new(w), insert(w, [1, 2, 3]), lookup([1, 2]), lookup([1, 2, 3, 4]), lookup([1, 7]),
                 insert(w, [5, 6, 7, 8, 9]), lookup([5, 6]), lookup([5, 6, 7, 8, 9, 1]), EVICT, lookup([1, 2, 3]),
                 insert(w, [1, 2, 3, 4]), lookup([1, 2, 3, 4, 5])]
        self.assertIsNone(self.replay(calls))
        from kvsim.drivers.vllm_mlx import VllmMlx

        s = kit.Server(VllmMlx())
        matched = [s.handle(c).get("matched") for c in calls]
        self.assertEqual(matched, [None, None, 2, 3, 1, None, 0, 5, None, 0, None, 4])

    def test_block_cache_restores_blocks_of_other_prefixes_and_whole_sequence_window_offsets(self):
        w = [None, 4]
        calls = [new(w), insert(w, [1, 2, 3, 4, 5]), insert(w, [7, 8, 3, 4]), lookup([7, 8, 3, 4, 5])]
        self.assertIn("[prefix_model] layer 0 K: element 8 (head 0, position 2, dim 0)",
                      self.replay(calls, "prefix_model", prefix="block"))
        self.assertIn("[prefix_offset] layer 1 was restored at offset 5, matched says 4",
                      self.replay(calls, "prefix_offset", prefix="block"))
        self.assertIn("[prefix_count] matched 2 of 2 tokens",
                      self.replay(calls[:2] + [lookup([3, 4])], "prefix_count", prefix="block"))

    def test_block_cache_insert_after_evict_restores_a_reused_block(self):
        w = [None]
        calls = [new(w), insert(w, [1, 2, 3, 4]), insert(w, [5, 6, 7, 8, 9, 10]), EVICT, lookup([1, 2, 3, 4]),
                 insert(w, [11, 12, 13, 14, 15, 16]), lookup([1, 2, 3, 4])]
        self.assertIn("call 6 (prefix_lookup of 4 tokens, matched 2): [prefix_model] layer 0 K",
                      self.replay(calls, prefix="block", blocks="8"))

    def test_planted_short_restore_is_caught_and_reproduced(self):
        w = [None]
        calls = [{"op": "reset"}, new(w), insert(w, [1, 2, 3]), lookup([1, 2, 3])]
        self.assertIsNone(self.replay(calls))
        self.assertIn("[prefix_offset] layer 0 was restored at offset 2, matched says 3",
                      self.replay(calls, plant="prefix-short"))
        from kvsim.drivers.vllm_mlx import VllmMlx

        s = kit.Server(VllmMlx(plant="prefix-short", prefix="block"))
        script = s.handle({"op": "reproducer", "calls": calls, "divergence": "prefix_warm_cold"})["script"]
        rc, out = run_script(script)
        self.assertEqual(rc, 1, out)
        self.assertIn("[prefix_warm_cold] layer 0 K", out)


@unittest.skipUnless(importlib.util.find_spec("mlx_vlm") is not None, "mlx-vlm is not installed")
class MlxVlmPrefix(unittest.TestCase):
    def replay(self, calls, divergence="prefix", **opts):
        from kvsim.drivers.mlx_vlm import MlxVlm

        return kit.replay(MlxVlm(**opts), calls, divergence)

    def matched(self, calls):
        from kvsim.drivers.mlx_vlm import MlxVlm

        s = kit.Server(MlxVlm())
        return [s.handle(c).get("matched") for c in calls]

    def test_dense_checkpoints_trim_to_blocks_and_window_stacks_match_whole_entries(self):
        dense = [new([None, None]), insert([None, None], [1, 2, 3, 4, 5]), lookup([1, 2, 3, 4, 5]), lookup([1, 2, 7]),
                 EVICT, lookup([1, 2, 3, 4, 5, 6]), insert([None, None], [1, 2, 3, 4, 5]), lookup([1, 2, 3, 4, 5, 6])]
        self.assertIsNone(self.replay(dense))
        self.assertEqual(self.matched(dense), [None, None, 4, 2, None, 0, None, 5])
        w = [None, 4]
        window = [new(w), insert(w, [1, 2, 3, 4, 5, 6]), lookup([1, 2, 3]), lookup([1, 2, 3, 4, 5, 6]),
                  lookup([1, 2, 3, 4, 5, 6, 7])]
        self.assertIsNone(self.replay(window))
        self.assertEqual(self.matched(window), [None, None, 0, 0, 6])

    def test_planted_short_restore_is_caught(self):
        w = [None, 4]
        calls = [new(w), insert(w, [1, 2, 3]), lookup([1, 2, 3, 4])]
        self.assertIn("[prefix_offset] layer 0 was restored at offset 2, matched says 3",
                      self.replay(calls, plant="prefix-short"))


if __name__ == "__main__":
    unittest.main()
