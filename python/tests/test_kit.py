"""Tests of the driver kit: framing, handshake, load_modules, reproducers, the array codec and the pool checker.

    PYTHONPATH=python python3 -m unittest discover -s python/tests            # standard library only
    PYTHONPATH=python oracles/mlx_lm/.venv/bin/python -m unittest discover -s python/tests     # + the codec
    PYTHONPATH=python oracles/vllm_mlx/.venv/bin/python -m unittest discover -s python/tests   # + vllm-mlx's pool

Tests needing mlx or vllm-mlx are skipped where they are not installed.
"""
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

from kvsim import kit, poolcheck

HAVE_MLX = importlib.util.find_spec("mlx") is not None
HAVE_VLLM_MLX = importlib.util.find_spec("vllm_mlx") is not None


class Counter(kit.Driver):
    """A driver without an engine: counters by id."""

    name = "counter"
    supports = {"serial_trim": True}

    def version(self):
        return "1.0"

    def op_new(self, r):
        self.handles[r["id"]] = [0]
        return {}

    def op_add(self, r):
        c = self.handles[r["id"]]
        c[0] += r["n"]
        if c[0] > 10:
            raise OverflowError("past 10")
        return {"total": c[0]}


def serve_lines(cls, lines, argv=()):
    out = io.StringIO()
    kit.serve(cls, argv=list(argv), stdin=io.StringIO("".join(l + "\n" for l in lines)), stdout=out)
    return [json.loads(l) for l in out.getvalue().splitlines()]


class Framing(unittest.TestCase):
    def test_one_reply_per_request_and_refusals(self):
        replies = serve_lines(Counter, ['{"op":"hello"}', "", "   ", "not json", '{"op":"nope"}', "[1]",
                                        '{"op":"new","id":1}', '{"op":"add","id":1,"n":4}',
                                        '{"op":"add","id":1,"n":9}', '{"op":"add","id":2,"n":1,"free":[1]}'])
        self.assertEqual(len(replies), 8)
        self.assertEqual(replies[0], {"ok": True, "protocol": 1, "engine": "counter", "version": "1.0",
                                      "supports": {"serial_trim": True}})
        self.assertTrue(replies[1]["error"].startswith("JSONDecodeError: "))
        self.assertEqual(replies[2], {"ok": False, "error": "ValueError: unknown op 'nope'"})
        self.assertTrue(replies[3]["error"].startswith("TypeError: "))
        self.assertEqual(replies[5], {"ok": True, "total": 4})
        self.assertEqual(replies[6], {"ok": False, "error": "OverflowError: past 10"})
        self.assertEqual(replies[7], {"ok": False, "error": "KeyError: 2"})

    def test_reset_and_free_drop_handles(self):
        d = Counter()
        s = kit.Server(d)
        s.handle({"op": "new", "id": 1})
        s.handle({"op": "new", "id": 2})
        s.handle({"op": "hello", "free": [1]})
        self.assertEqual(sorted(d.handles), [2])
        s.handle({"op": "reset"})
        self.assertEqual(d.handles, {})

    def test_protocol_2_for_a_pool_driver_and_options(self):
        class Pool(Counter):
            supports = {"kv": False, "pool": True}
            options = {"mode": ("a", "b")}

        self.assertEqual(serve_lines(Pool, ['{"op":"hello"}'])[0]["protocol"], 2)
        self.assertEqual(Pool(mode="b").opts, {"mode": "b"})
        with self.assertRaises(SystemExit):
            serve_lines(Pool, ['{"op":"hello"}'], argv=["--mode", "c"])


def serve_bytes(cls, lines):
    """`serve` on a byte stream (binary frames possible): the raw output."""
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, write_through=True)
    kit.serve(cls, argv=[], stdin=io.StringIO("".join(l + "\n" for l in lines)), stdout=out)
    return raw.getvalue()


def frames(data):
    """(reply, frame bytes) per reply of a byte stream (oracles/PROTOCOL.md, "Binary frames")."""
    out = []
    while data:
        line, _, data = data.partition(b"\n")
        reply = json.loads(line)
        n = reply.get("blob", 0) if line.startswith(b'{"blob":') else 0
        out.append((reply, data[:n]))
        data = data[n:]
    return out


class Arrays(Counter):
    supports = {"kv": True, "pool": True}  # protocol 2

    def op_arr(self, r):
        import mlx.core as mx

        return {"x": kit.arr_out(mx.array([1.5, -2.0])), "y": kit.arr_out(mx.array([7.0]))}


@unittest.skipUnless(HAVE_MLX, "needs mlx")
class BinaryFrames(unittest.TestCase):
    def test_taken_when_offered_arrays_are_spans_of_the_frame(self):
        import struct

        got = frames(serve_bytes(Arrays, ['{"op":"hello","binary":true}', '{"op":"arr"}', '{"op":"new","id":1}',
                                          '{"op":"batch","requests":[{"op":"arr"},{"op":"nope"},{"op":"arr"}]}']))
        self.assertTrue(got[0][0]["supports"]["binary"])
        (reply, blob) = got[1]
        self.assertEqual(reply["blob"], 12)
        self.assertEqual(reply["x"], {"dtype": "f32", "shape": [2], "off": 0, "len": 8})
        self.assertEqual(struct.unpack("<2f", blob[0:8]), (1.5, -2.0))
        self.assertEqual(struct.unpack("<f", blob[reply["y"]["off"]:][:4]), (7.0,))
        self.assertEqual(got[2], ({"ok": True}, b""))  # no arrays: a JSON line
        batch, blob = got[3]
        subs = batch["replies"]
        self.assertEqual([r["ok"] for r in subs], [True, False, True])
        self.assertEqual(subs[2]["x"]["off"], 12)
        self.assertEqual(struct.unpack("<f", blob[subs[2]["y"]["off"]:][:4]), (7.0,))

    def test_not_offered_or_declined_every_reply_is_a_json_line_with_base64(self):
        for hello, env in (('{"op":"hello"}', "1"), ('{"op":"hello","binary":true}', "0")):
            os.environ["KVSIM_KIT_BINARY"] = env
            try:
                got = frames(serve_bytes(Arrays, [hello, '{"op":"arr"}']))
            finally:
                del os.environ["KVSIM_KIT_BINARY"]
            self.assertNotIn("binary", got[0][0]["supports"])
            self.assertEqual(got[1][0]["x"], {"dtype": "f32", "shape": [2], "b64": "AADAPwAAAMA="})
            self.assertEqual(got[1][1], b"")

    def test_a_text_stream_never_frames(self):
        out = io.StringIO()
        kit.serve(Arrays, argv=[], stdin=io.StringIO('{"op":"hello","binary":true}\n{"op":"arr"}\n'), stdout=out)
        hello, arr = [json.loads(l) for l in out.getvalue().splitlines()]
        self.assertNotIn("binary", hello["supports"])
        self.assertIn("b64", arr["x"])


class LoadModules(unittest.TestCase):
    def test_submodule_without_package_init(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "heavy_pkg", "inner"))
            files = {"heavy_pkg/__init__.py": "raise ImportError('needs transformers')\n",
                     "heavy_pkg/inner/__init__.py": "raise ImportError('needs transformers')\n",
                     "heavy_pkg/inner/leaf.py": "VALUE = 7\n"}
            for name, text in files.items():
                with open(os.path.join(d, name), "w") as f:
                    f.write(text)
            sys.path.insert(0, d)
            try:
                (leaf,) = kit.load_modules("heavy_pkg", ["inner.leaf"])
                self.assertEqual(leaf.VALUE, 7)
            finally:
                sys.path.remove(d)
                for m in [m for m in sys.modules if m.startswith("heavy_pkg")]:
                    del sys.modules[m]


class Reproducer(unittest.TestCase):
    def run_script(self, script):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "repro.py")
            with open(path, "w") as f:
                f.write(script)
            p = subprocess.run([sys.executable, "-I", path], capture_output=True, text=True, cwd=d)
            return p.returncode, p.stdout + p.stderr

    def test_standalone_exits_1_while_the_divergence_is_there(self):
        calls = [{"op": "reset"}, {"op": "new", "id": 1}, {"op": "add", "id": 1, "n": 11}]
        s = kit.Server(Counter()).handle({"op": "reproducer", "calls": calls, "divergence": "adapter_error"})["script"]
        self.assertNotIn("\nfrom kvsim", s)
        rc, out = self.run_script(s)
        self.assertEqual(rc, 1, out)
        self.assertIn("counter raised at call 2 (add): OverflowError: past 10", out)
        s = kit.Server(Counter()).handle({"op": "reproducer", "calls": calls[:2], "divergence": "adapter_error"})
        rc, out = self.run_script(s["script"])
        self.assertEqual(rc, 0, out)


@unittest.skipUnless(HAVE_MLX, "mlx is not installed")
class Codec(unittest.TestCase):
    def test_bit_exact_round_trip(self):
        import base64
        import struct

        words = [0x7FC00001, 0xFF800000, 0x00000001, 0x80000000, 0x3F800000, 0x7F7FFFFF]
        a = {"dtype": "f32", "shape": [2, 3], "b64": base64.b64encode(struct.pack("<6I", *words)).decode()}
        self.assertEqual(kit.materialize(kit.arr_out(kit.arr_in(a))), a)
        h = [0x7FC1, 0x0001, 0x8000, 0x3F80]
        b = {"dtype": "bf16", "shape": [1, 4], "b64": base64.b64encode(struct.pack("<4H", *h)).decode()}
        self.assertEqual(kit.materialize(kit.arr_out(kit.arr_in(b))), b)
        e = {"dtype": "f32", "shape": [1, 2, 0, 4], "b64": ""}
        self.assertEqual(kit.materialize(kit.arr_out(kit.arr_in(e))), e)
        with self.assertRaises(ValueError):
            kit.arr_in({"dtype": "f32", "shape": [2], "b64": "AAAA"})


    def test_u32_and_quantized_planes(self):
        import base64
        import struct

        import mlx.core as mx

        words = [0xFFFFFFFF, 0, 0x80000001]
        u = {"dtype": "u32", "shape": [3], "b64": base64.b64encode(struct.pack("<3I", *words)).decode()}
        self.assertEqual(kit.materialize(kit.arr_out(kit.arr_in(u))), u)

        class Cache:  # an mlx-style quantized cache: planes in a bigger buffer, `offset` positions held
            offset = 3
        c = Cache()
        x = mx.arange(2 * 8 * 64, dtype=mx.float32).reshape(1, 2, 8, 64) / 16
        c.keys = c.values = mx.quantize(x, group_size=32, bits=5)
        g = {"heads_kv": 2, "head_dim": 64, "dtype": "f32", "max_size": None, "quant": {"bits": 5, "group_size": 32}}
        r = kit.materialize(kit.state_reply(c, g))
        self.assertEqual(r["k"]["packed"]["shape"], [1, 2, 3, 10])  # 64 * 5 / 32 words per position
        self.assertEqual(r["v"]["scales"]["shape"], [1, 2, 3, 2])
        c.keys = None
        r = kit.materialize(kit.state_reply(c, g))
        self.assertEqual(r["k"]["biases"]["shape"], [1, 2, 0, 2])


class Checks(unittest.TestCase):
    def test_missing_row_accepted_follows_the_rows_from_the_calls(self):
        calls = [{"op": "merge", "id": 3, "rows": [1, 2]}, {"op": "filter", "id": 3, "keep": [1]},
                 {"op": "extract", "id": 3, "row": 1, "new": 4}]
        self.assertIn("a batch of 1 rows", kit.check_missing_row_accepted(calls, [{"ok": True}] * 3))
        self.assertIsNone(kit.check_missing_row_accepted(calls, [{"ok": True}] * 2 + [{"ok": False}]))
        calls[1] = {"op": "extend", "id": 3, "other": 5}
        calls.insert(0, {"op": "merge", "id": 5, "rows": [6]})
        self.assertIsNone(kit.check_missing_row_accepted(calls, [{"ok": True}] * 4))

    def test_rows_vs_solo_compares_only_the_real_queries_of_a_padded_window(self):
        import base64
        import struct

        def arr(shape, values):
            return {"dtype": "f32", "shape": shape, "b64": base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()}

        # 2 rows, 1 head, 2 queries, dim 1: row 0 has one real query (value 1.0, then padding 9.0), row 1 none
        calls = [{"op": "rows_window", "id": 3, "real": [1, 0]}, {"op": "window", "id": 1}]
        batch = {"ok": True, "out": arr([2, 1, 2, 1], [1.0, 9.0, 5.0, 5.0])}
        self.assertIsNone(kit.check_rows_vs_solo(calls, [batch, {"ok": True, "out": arr([1, 1, 1, 1], [1.0])}]))
        said = kit.check_rows_vs_solo(calls, [batch, {"ok": True, "out": arr([1, 1, 1, 1], [2.0])}])
        self.assertIn("row 0 differs", said)


@unittest.skipUnless(HAVE_VLLM_MLX, "vllm-mlx is not installed")
class VllmMlxPool(unittest.TestCase):
    def replay(self, calls, **opts):
        from kvsim.drivers.vllm_mlx import VllmMlx

        return kit.replay(VllmMlx(**opts), calls, "pool")

    def test_chain_lookup_holds_and_fetch_cache_lookup_crosses_prefixes(self):
        P = lambda op, **kw: dict(op=op, id=1, **kw)  # noqa: E731
        calls = [P("pool_new", block_size=2, blocks=10), P("pool_alloc", seq=1, tokens=[1, 2, 3, 4]),
                 P("pool_cache", seq=1, tokens=[1, 2, 3, 4]), P("pool_alloc", seq=2, tokens=[5, 6, 3, 4]),
                 P("pool_cache", seq=2, tokens=[5, 6, 3, 4]), P("pool_hit", seq=3, tokens=[1, 2, 3, 4]),
                 P("pool_free", seq=1), P("pool_free", seq=2), P("pool_free", seq=3)]
        self.assertIsNone(self.replay(calls, lookup="chain"))
        self.assertIn("[pool_lookup] block 1 of the answer, block 4", self.replay(calls))

    def test_planted_cow_is_caught(self):
        P = lambda op, **kw: dict(op=op, id=1, **kw)  # noqa: E731
        calls = [P("pool_new", block_size=2, blocks=10), P("pool_alloc", seq=1, tokens=[1, 2, 3]),
                 P("pool_fork", seq=1, new=2), P("pool_cow", seq=1)]
        self.assertIn("still held by seqs [2]", self.replay(calls, plant="cow-keeps-shared"))
        self.assertIn("share storage", self.replay(calls))
        self.assertEqual(poolcheck.CHECKS[2], "pool_cow")


if __name__ == "__main__":
    unittest.main()
