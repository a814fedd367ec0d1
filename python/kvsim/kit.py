"""The driver kit: everything of an engine driver that is not the engine's cache calls.

A driver serves kvsim's engine protocol (oracles/PROTOCOL.md, "The engine protocol") over JSON lines. The kit owns
the framing, the array codec, the handle table, refusals, the `hello` handshake, loading an engine's modules without
its package `__init__`, and the `reproducer` request. A driver is a small module: a subclass of `Driver` with one
`op_<request>` method per request it serves, and a main guard that hands the class to `serve`:

    from kvsim import kit

    class Engine(kit.Driver):
        name = "my-engine"                       # hello's `engine`
        supports = {"kv": False, "pool": True}   # hello's `supports`
        options = {"plant": (None, "bug")}       # command-line options: --plant bug

        def version(self):                       # hello's `version`
            return kit.package_version("my-engine")

        def op_pool_new(self, r):                # a request -> its reply fields ({} for none)
            self.handles[r["id"]] = make_pool(r["block_size"], r["blocks"])
            return {"usable": r["blocks"]}

    if __name__ == "__main__":
        kit.serve(Engine)

Run it as `python -m kvsim.drivers.<engine> [--option value ...]` with `PYTHONPATH=<repo>/python` and the engine's
venv python. An exception a handler raises is the refusal `{"ok": false, "error": "<Type>: <message>"}`; the engine's
objects are left as the exception left them.

This module, `kvsim.poolcheck`, `kvsim.prefixcheck` and `kvsim.reccheck` are the kit's core: they import only the standard library (mlx
lazily, in the array codec and the cache view), so a reproducer carries them verbatim beside the driver's module
source (`reproducer`).
"""
import base64
import importlib
import importlib.util
import json
import os
import struct
import sys
import types

# ---- framing, refusals and the handshake ----

PROTOCOL_1_SUPPORTS = ("serial_trim", "rows_window", "rows_trim", "join", "rotating", "kv")


def refusal(e):
    """The reply for an exception: `{"ok": false, "error": "<Type>: <message>"}`."""
    return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def package_version(dist):
    """The installed version of distribution `dist` (e.g. "mlx-lm")."""
    from importlib import metadata

    return metadata.version(dist)


class Handles(dict):
    """Engine objects by the ids kvsim gives them (`free` drops some, `reset` all)."""

    def free(self, ids):
        for i in ids:
            self.pop(i, None)


class Driver:
    """Base of a driver: subclass it, set `name` and `supports`, define `version()` and `op_<request>` methods.

    `options` names the driver's command-line options and their allowed values (the first is the default); the
    chosen values arrive as keyword arguments and are kept in `self.opts`. `hello_extra()` adds reply fields to
    `hello`. `on_reset()` runs after the kit has emptied `self.handles` on `reset`.
    """

    name = "engine"
    supports = {}
    options = {}
    protocol = None  # None: 2 when the driver serves requests beyond protocol 1 (`pool`, or `kv` false), else 1
    binary = True  # take kvsim's offer of binary frames (protocol 2 only; KVSIM_KIT_BINARY=0 declines it)

    def __init__(self, **opts):
        self.opts = {k: v[0] for k, v in self.options.items()}
        for k, v in opts.items():
            if k not in self.options:
                raise ValueError(f"{self.name} has no option {k!r} (options: {sorted(self.options)})")
            if v not in self.options[k]:
                raise ValueError(f"--{k} {v!r}: allowed {[x for x in self.options[k] if x is not None]}")
            self.opts[k] = v
        self.handles = Handles()

    def version(self):
        return "unknown"

    def hello_extra(self):
        return {}

    def on_reset(self):
        pass

    def protocol_version(self):
        if self.protocol is not None:
            return self.protocol
        beyond = any(v for k, v in self.supports.items() if k not in PROTOCOL_1_SUPPORTS)
        return 2 if beyond or self.supports.get("kv") is False else 1


class BatchCalls:
    """The batch requests of an engine whose batch caches have mlx-lm's batch API (mlx-lm's `BatchKVCache` and
    `BatchRotatingKVCache`, and the classes of mlx-vlm and mlx-optiq that share it): `extend`, `offset` (one per row),
    `extract`, `filter`, `prepare(lengths=, right_padding=)` and `finalize()`. Mixed into a `Driver` before it
    (`class MyEngine(kit.BatchCalls, kit.Driver)`); a driver overrides `offset_of` or `state_of` where its caches
    differ. `rows_prepare` calls `prepare` only when some row is padded, as mlx-lm's `BatchGenerator.prompt`
    (mlx-lm 0.32.2 `generate.py:1218-1221`) and mlx-vlm's batch generator (0.7.10 `generate/ar.py:1898-1907`) do."""

    @staticmethod
    def offset_of(c):
        return c.offset

    def state_of(self, c):
        return state_reply(c, self.geometry)

    def op_extend(self, r):
        self.handles[r["id"]].extend(self.handles.pop(r["other"]))
        return {}

    def op_rows_info(self, r):
        offsets = self.offset_of(self.handles[r["id"]])  # evaluated with the reply's other arrays (`ints_out`)
        return {"rows": int(offsets.shape[0]), "offsets": ints_out(offsets)}

    def op_extract(self, r):
        self.handles[r["new"]] = self.handles[r["id"]].extract(r["row"])
        return {}

    def op_filter(self, r):
        self.handles[r["id"]].filter(r["keep"])
        return {}

    def op_rows_prepare(self, r):
        if max(r["right_padding"], default=0) > 0:
            self.handles[r["id"]].prepare(lengths=r["lengths"], right_padding=r["right_padding"])
        return {}

    def op_rows_finalize(self, r):
        self.handles[r["id"]].finalize()
        return {}

    def op_rows_state(self, r):
        return self.state_of(self.handles[r["id"]].extract(r["row"]))


class RecCalls:
    """The recurrent-state requests of an engine whose recurrent caches have mlx-lm's `ArraysCache` API (mlx-lm's,
    mlx-vlm's own copy, vllm-mlx's `BatchMambaCache` over mlx-lm's): `merge` (the class method of the first row),
    `extend`, `filter`, `extract`, `prepare(lengths=, right_padding=)`, `finalize()`, the arrays in `cache.cache`
    and `batch_size`. Mixed into a `Driver` before it; the driver has `op_rec_new` and `op_rec_write` (how its model
    layers write), and overrides `op_rec_merge` where its batches are another class. `--plant rec-neighbour` (the
    driver's option): a filter's first kept row takes its neighbour's state. `--rec-prefill no` (the driver's option):
    no right-padded prompt batch is drawn (`supports.rec_prefill` off), the runs recorded before them."""

    def __init__(self, **opts):
        super().__init__(**opts)
        if self.opts.get("rec_prefill") == "no":
            self.supports = dict(self.supports, rec_prefill=False)

    def op_rec_merge(self, r):
        rows = [self.handles.pop(i) for i in r["rows"]]
        self.handles[r["id"]] = rows[0].merge(rows)
        return {}

    def op_rec_extend(self, r):
        self.handles[r["id"]].extend(self.handles.pop(r["other"]))
        return {}

    def op_rec_filter(self, r):
        c, keep = self.handles[r["id"]], list(r["keep"])
        if self.opts.get("plant") == "rec-neighbour" and keep[0] + 1 < c.batch_size and keep[0] + 1 not in keep:
            keep[0] += 1  # a negative control: the first kept row takes its neighbour's state
        c.filter(keep)
        return {}

    def op_rec_extract(self, r):
        self.handles[r["new"]] = self.handles[r["id"]].extract(r["row"])
        return {}

    def op_rec_prepare(self, r):
        """`prepare(lengths=..., right_padding=...)`, as mlx-lm's `BatchGenerator.prompt` prepares a padded prompt
        batch (mlx-lm 0.32.2 `generate.py:1218-1221`)."""
        self.handles[r["id"]].prepare(lengths=list(r["lengths"]), right_padding=list(r["right_padding"]))
        return {}

    def op_rec_finalize(self, r):
        self.handles[r["id"]].finalize()
        return {}

    def op_rec_state(self, r):
        return rec_arrays(self.handles[r["id"]].cache)

    def op_rec_rows_state(self, r):
        return rec_arrays(self.handles[r["id"]].cache, r["row"])

    def op_rec_rows_info(self, r):
        return {"rows": int(self.handles[r["id"]].batch_size)}


class Server:
    """One driver behind the protocol: `handle(request) -> reply` (hello, reset, free and dispatch)."""

    def __init__(self, driver, can_frame=False):
        self.driver = driver
        self.can_frame = can_frame  # whether the output can carry binary frames (`serve` on a byte stream)
        self.binary = False  # agreed in `hello`: replies carry their arrays' bytes in a frame (`blob`)
        self.blob = b""  # the frame bytes of the last reply (empty: a JSON line)

    def handle(self, req):
        """The reply to `req`, its arrays' bytes written (`materialize`): base64 in the reply, or, once binary frames
        are agreed, spans of `self.blob`. An array that fails to evaluate makes its request's reply a refusal, as if
        its handler had raised (a `batch`'s other replies stand)."""
        saved = _FRAME["on"], _FRAME["blob"]
        _FRAME["on"], _FRAME["blob"] = self.binary, bytearray()
        try:
            return self._handle(req)
        finally:
            self.blob = bytes(_FRAME["blob"])
            _FRAME["on"], _FRAME["blob"] = saved

    def _handle(self, req):
        _PENDING.clear()
        reply = self.handle_lazily(req)
        if isinstance(req, dict) and req.get("op") == "batch" and reply.get("ok"):
            subs = reply["replies"]
            try:
                materialize(reply)
            except Exception:  # evaluate request by request: only the ones that fail are refusals
                for i, sub in enumerate(subs):
                    try:
                        materialize(sub, owner=i)
                    except Exception as e:
                        subs[i] = refusal(e)
                _PENDING.clear()
            return reply
        try:
            return materialize(reply)
        except Exception as e:
            _PENDING.clear()
            return refusal(e)

    def handle_lazily(self, req):
        if not isinstance(req, dict):
            return {"ok": False, "error": f"TypeError: a request is a JSON object, not {type(req).__name__}"}
        d = self.driver
        try:
            d.handles.free(req.get("free", []))
            op = req.get("op")
            if op == "hello":
                out = dict(d.hello_extra())
                protocol = d.protocol_version()
                # protocol 2: the kit answers `batch` for every driver (several requests in one round trip)
                supports = dict(d.supports, batch=True) if protocol >= 2 else dict(d.supports)
                # binary frames: offered by kvsim (`"binary": true`), taken by a protocol-2 driver that can
                if (req.get("binary") is True and protocol >= 2 and d.binary and self.can_frame
                        and os.environ.get("KVSIM_KIT_BINARY", "1") != "0"):
                    supports["binary"] = True
                    self.binary = True
                out.update(protocol=protocol, engine=d.name, version=d.version(), supports=supports)
            elif op == "batch":
                out = {"replies": []}
                for i, sub in enumerate(req["requests"]):
                    _OWNER[0] = i
                    out["replies"].append(self.handle_lazily(sub))
                _OWNER[0] = None
            elif op == "reset":
                d.handles.clear()
                d.on_reset()
                out = {}
            elif op == "reproducer":
                out = {"script": reproducer(d, req)}
            else:
                f = getattr(d, "op_" + str(op), None)
                if f is None:
                    raise ValueError(f"unknown op {op!r}")
                out = f(req)
        except Exception as e:  # the engine raised: reported, never hidden
            return refusal(e)
        out["ok"] = True
        return out


def parse_options(cls, argv):
    """`--name value` pairs -> keyword arguments for `cls`."""
    opts, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("--") or i + 1 >= len(argv):
            raise SystemExit(f"usage: --option value ... (options of {cls.name}: {sorted(cls.options)})")
        opts[a[2:].replace("-", "_")] = argv[i + 1]
        i += 2
    return opts


def serve(cls, argv=None, stdin=None, stdout=None):
    """Serve `cls(**options)` on JSON lines: one reply per request, blank lines skipped."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        server = Server(cls(**parse_options(cls, sys.argv[1:] if argv is None else argv)))
    except Exception as e:  # a bad option: kvsim sees a refused hello, the reason on stderr
        print(json.dumps(refusal(e)), file=stdout, flush=True)
        print(f"{cls.name}: {e}", file=sys.stderr)
        raise SystemExit(3)
    out = getattr(stdout, "buffer", None)  # binary frames need a byte stream
    server.can_frame = out is not None
    for line in stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except ValueError as e:
            reply, server.blob = refusal(e), b""
        else:
            reply = server.handle(req)
        if out is None:
            stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
            stdout.flush()
            continue
        blob = server.blob
        if blob:  # a binary frame: the line, then exactly its bytes (oracles/PROTOCOL.md, "Binary frames")
            reply = {"blob": len(blob), **reply}
        out.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n" + blob)  # one write: one wake-up
        out.flush()


# ---- loading an engine's modules ----


def load_modules(package, submodules):
    """Import `package.<sub>` for each of `submodules` without running the `__init__` of `package` or of any
    package between it and the submodule (they may pull in transformers or huggingface_hub): each such package is
    registered as an empty stub whose `__path__` is its directory. Returns the modules, in order."""
    spec = importlib.util.find_spec(package) if package not in sys.modules else None
    if package not in sys.modules and (spec is None or not spec.submodule_search_locations):
        raise ImportError(f"{package} is not installed")
    root = next(iter(spec.submodule_search_locations)) if spec else list(sys.modules[package].__path__)[0]
    out = []
    for sub in submodules:
        parts = sub.split(".")
        name, path = package, root
        for part in [None] + parts[:-1]:
            if part is not None:
                name, path = f"{name}.{part}", os.path.join(path, part)
            if name not in sys.modules:
                stub = types.ModuleType(name)
                stub.__path__ = [path]
                stub.__package__ = name
                sys.modules[name] = stub
        out.append(importlib.import_module(f"{package}.{sub}"))
    return out


# ---- arrays: {"dtype": "f32" | "bf16" | "u32", "shape", "b64"}, little-endian row-major element bits ----

_CODEC = {}


def _codec():
    """mlx and its dtype tables, imported on first use (a pool driver never needs mlx)."""
    if not _CODEC:
        import mlx.core as mx

        _CODEC.update(
            mx=mx,
            dtypes={"f32": (mx.float32, mx.uint32, "I", 4), "bf16": (mx.bfloat16, mx.uint16, "H", 2),
                    "u32": (mx.uint32, mx.uint32, "I", 4)},
            names={mx.float32: "f32", mx.bfloat16: "bf16", mx.uint32: "u32"},
        )
    return _CODEC


def mx_dtype(name):
    """The mlx dtype of a protocol dtype name."""
    return _codec()["dtypes"][name][0]


def arr_in(a):
    """`{"dtype", "shape", "b64"}` -> an mx.array with exactly those element bits."""
    c = _codec()
    mx = c["mx"]
    dt, _, fmt, size = c["dtypes"][a["dtype"]]
    shape = [int(s) for s in a["shape"]]
    raw = base64.b64decode(a["b64"], validate=True)
    n = 1
    for s in shape:
        n *= s
    if len(raw) != n * size:
        raise ValueError(f"array of shape {shape} {a['dtype']} needs {n * size} bytes, b64 holds {len(raw)}")
    if n == 0:
        return mx.zeros(shape, dtype=dt)
    return mx.array(memoryview(raw).cast(fmt)).reshape(shape).view(dt)


def raw_of(x):
    """Row-major little-endian element bytes of an mx.array (evaluated here if it is not yet: one graph evaluation;
    the buffer's own strides are followed, so a sliced view needs no copy op)."""
    if x.size == 0:
        return b""
    _codec()["mx"].eval(x)  # nothing left to do when `materialize` evaluated it
    return memoryview(x).tobytes()


_PENDING = []  # (owner, reply dict, array) of every array encoded since the last `materialize`
_FRAME = {"on": False, "blob": bytearray()}  # binary frames agreed (the handling server's), the reply's bytes
_OWNER = [None]  # the index of the `batch` request being handled (None outside a batch)


def arr_out(x):
    """The protocol's array of `x`; its bytes are written when the reply is complete (`materialize`), so that
    every array of a reply (a `batch`'s included) is evaluated in one graph evaluation."""
    a = {"dtype": _codec()["names"][x.dtype], "shape": list(x.shape), "b64": None}
    _PENDING.append((_OWNER[0], a, x))
    return a


def ints_out(x):
    """The ints of a 1-D mx.array `x` (e.g. a batch cache's `offset`) as a reply's list, written when the reply is
    complete (`materialize`): in the same graph evaluation as the reply's arrays (a `batch`'s included), not one of its
    own. `x` is taken as it is now (a later in-place update of the object does not change the answer)."""
    out = []
    _PENDING.append((_OWNER[0], out, _codec()["mx"].array(x)))
    return out


def arrs_out(*xs):
    return [arr_out(x) for x in xs]


def materialize(reply, owner="all"):
    """Evaluates the arrays encoded since the last call (those of one batch request, `owner`, or all) at once and
    writes their base64 bytes; returns `reply`. Raises what the evaluation raises, the arrays left pending."""
    mine = [p for p in _PENDING if owner == "all" or p[0] == owner]
    if mine:
        _codec()["mx"].eval(*[x for _, _, x in mine if x.size])
        for _, a, x in mine:
            if isinstance(a, list):  # `ints_out`
                a.extend(int(v) for v in x.tolist())
            elif _FRAME["on"]:  # a span of the reply's frame bytes instead of base64
                raw, blob = raw_of(x), _FRAME["blob"]
                del a["b64"]
                a["off"], a["len"] = len(blob), len(raw)
                blob += raw
            else:
                a["b64"] = base64.b64encode(raw_of(x)).decode()
        _PENDING[:] = [p for p in _PENDING if not (owner == "all" or p[0] == owner)]
    return reply


def _each(x, f):
    """`f` of an array, or of each plane of a quantized triple (a tuple back)."""
    return tuple(f(p) for p in x) if isinstance(x, (tuple, list)) else f(x)


def kv_view(c, window):
    """(k, v): the K/V the next read of an mlx-style cache `c` attends, oldest first, or None for a cache holding
    no arrays yet: the first `offset` positions of a full-attention cache (`window` None); under a window, the newest
    min(offset, window) positions of the cache's temporal order (its own `_temporal_order`). A quantized cache's
    K and V are each a triple `(packed, scales, biases)`, every plane sliced alike."""
    if c.keys is None or (isinstance(c.keys, (tuple, list)) and not c.keys):
        return None
    if not window:
        return tuple(_each(x, lambda p: p[..., : c.offset, :]) for x in (c.keys, c.values))
    k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
    width = (k[0] if isinstance(k, (tuple, list)) else k).shape[2]
    n = max(0, min(c.offset, window, width))
    return tuple(_each(x, lambda p: p[..., width - n :, :]) for x in (k, v))


def empty_planes(geometry):
    """The three planes of no position, `(packed, scales, biases)`, of a quantized `geometry`."""
    mx, q, d = _codec()["mx"], geometry["quant"], geometry["head_dim"]
    h, dt = geometry["heads_kv"], mx_dtype(geometry["dtype"])
    return (mx.zeros([1, h, 0, d * q["bits"] // 32], dtype=mx.uint32),
            mx.zeros([1, h, 0, d // q["group_size"]], dtype=dt), mx.zeros([1, h, 0, d // q["group_size"]], dtype=dt))


def state_reply(c, geometry):
    """A `state` / `rows_state` reply of cache `c` (its `kv_view` under the geometry's window): `k` and `v` arrays,
    or for a quantized geometry (`geometry["quant"]`) each an object of the planes `packed`, `scales`, `biases`."""
    view = kv_view(c, geometry.get("max_size"))
    if geometry.get("quant"):
        k, v = view if view is not None else (empty_planes(geometry),) * 2
        return {side: dict(zip(("packed", "scales", "biases"), arrs_out(*planes)))
                for side, planes in (("k", k), ("v", v))}
    if view is None:
        view = (empty_kv(geometry["heads_kv"], geometry["head_dim"], geometry["dtype"]),) * 2
    k, v = arrs_out(*view)
    return {"k": k, "v": v}


def empty_kv(heads_kv, head_dim, dtype):
    """A `[1, heads_kv, 0, head_dim]` array of the protocol dtype `dtype` (the view of an empty cache)."""
    return _codec()["mx"].zeros([1, heads_kv, 0, head_dim], dtype=mx_dtype(dtype))


def layer_states(caches, geometry, short=False):
    """A prefix reply's `states`: per cache `{"offset", "k", "v"}`, the view of `kv_view` under the cache's own
    window (its `max_size`; none for a cache without one), `geometry` (`heads_kv`, `head_dim`, `dtype`) giving the
    empty view's shape. `short` (a planted bug, never an engine's answer): each layer one position short, its newest
    dropped and its offset one less."""
    out = []
    for c in caches:
        view = kv_view(c, getattr(c, "max_size", None))
        if view is None:
            view = (empty_kv(geometry["heads_kv"], geometry["head_dim"], geometry["dtype"]),) * 2
        k, v = view
        offset = int(c.offset)
        if short:
            k, v, offset = k[..., : max(0, k.shape[2] - 1), :], v[..., : max(0, v.shape[2] - 1), :], offset - 1
        k, v = arrs_out(k, v)
        out.append({"offset": offset, "k": k, "v": v})
    return out


def rec_masked_write(c, n, states, unmasked=False):
    """A recurrent layer's write of `n` steps into an mlx-lm-style `ArraysCache` `c` (`states`: per array
    `[B, n, ...]`, kvsim's state after each step, `arr_in` form): each array becomes each row's state after the last
    step the cache's own `make_mask(n)` keeps (a row none of whose steps it keeps keeps its array; a cache with no
    array yet holds the zero state), as mlx-lm's recurrent layers mask a right-padded prompt's padding (e.g.
    `models/qwen3_next.py`: `mx.where(mask, ...)` and the conv window taken at `cache.lengths`); then
    `advance(n)`, as every such layer calls it. Without padding (`make_mask` None) that is the last step.
    `unmasked`: a negative control, the mask ignored (every row takes its last step, padding included)."""
    mask = None if unmasked or not hasattr(c, "make_mask") else c.make_mask(n)
    for i, s in enumerate(states):
        c[i] = rec_last_kept(arr_in(s), mask, c[i])
    if hasattr(c, "advance"):
        c.advance(n)


def rec_last_kept(x, mask, old):
    """Each row's state after its last step `mask` keeps: `x` is `[B, n, ...]` (the state after each step), `mask`
    `[B, n]` (or broadcastable; None: every step kept), `old` the rows' state before the steps (None: zeros). A row
    none of whose steps is kept keeps `old`, as a masked recurrent scan leaves it."""
    mx = _codec()["mx"]
    if mask is None:
        return x[:, -1]
    rows, n = x.shape[0], x.shape[1]
    keep = mx.broadcast_to(mask, (rows, n)).astype(mx.int32)
    last = (keep * mx.arange(1, n + 1)).max(axis=1) - 1  # each row's last kept step, -1 where none is kept
    at = mx.maximum(last, 0).reshape((rows, 1) + (1,) * (x.ndim - 2))
    taken = mx.take_along_axis(x, mx.broadcast_to(at, (rows, 1) + tuple(x.shape[2:])), axis=1)[:, 0]
    old = old if old is not None else mx.zeros_like(taken)
    return mx.where((last >= 0).reshape((rows,) + (1,) * (taken.ndim - 1)), taken, old)


def rec_arrays(arrays, row=None):
    """A `rec_state` / `rec_rows_state` reply of a recurrent cache's state arrays (mlx-lm style: `cache.cache`): each
    array, or its row `row` (`[1, ...]`; a row the arrays do not have raises), null where the cache holds none."""
    if row is not None:
        rows = next((x.shape[0] for x in arrays if x is not None), None)
        if rows is not None and not 0 <= row < rows:
            raise IndexError(f"row {row} of a batch of {rows}")
    return {"arrays": [None if x is None else arr_out(x if row is None else x[row:row + 1]) for x in arrays]}


# ---- the protocol-1 divergence checks a reproducer re-runs ----

ELEMENT = {"f32": ("I", 4), "bf16": ("H", 2)}


def first_difference(a, b, dtype):
    """(element index, value in a, value in b) of the first element whose bits differ, else None."""
    fmt, size = ELEMENT[dtype]
    for i in range(0, min(len(a), len(b)), size):
        if a[i : i + size] != b[i : i + size]:
            x, y = struct.unpack("<" + fmt, a[i : i + size])[0], struct.unpack("<" + fmt, b[i : i + size])[0]
            if dtype == "bf16":
                x, y = x << 16, y << 16
            fx, fy = struct.unpack("<f", struct.pack("<I", x))[0], struct.unpack("<f", struct.pack("<I", y))[0]
            return i // size, fx, fy
    return None


def check_rows_vs_solo(calls, replies):
    """The last rows read against each row's twin read right after it, in row order. In a right-padded prefill's
    window the request's `real` gives each row's real queries (its first ones): a row with none has no twin read, the
    others are compared on those columns only."""
    i = max(j for j, r in enumerate(calls) if r["op"] in ("rows_decode", "rows_window"))
    out = replies[i]["out"]
    (rows, heads, length, dim), dtype = out["shape"], out["dtype"]
    real = calls[i].get("real") or [length] * rows
    raw = base64.b64decode(out["b64"])
    size = ELEMENT[dtype][1]
    n = len(raw) // rows
    twin = i + 1
    for r in range(rows):
        if real[r] == 0:
            continue
        row = raw[r * n : (r + 1) * n]
        step, keep = length * dim * size, real[r] * dim * size
        row = b"".join(row[h * step : h * step + keep] for h in range(heads))
        solo = base64.b64decode(replies[twin]["out"]["b64"])
        d = first_difference(row, solo, dtype)
        if d is not None:
            return (f"call {i} ({calls[i]['op']}): row {r} differs from the same request run alone on its own serial "
                    f"cache (call {twin}): element {d[0]} is {d[1]!r} in the batch, {d[2]!r} alone")
        twin += 1
    return None


def check_rows_trim_vs_solo(calls, replies):
    """The last call, a `rows_trim` (or a per-row `rows_trim_rows`, one count per row), against the twin `trim`
    calls before it (row by row, each row's layers in order; earlier layers' batch trims may stand between)."""
    i = len(calls) - 1
    j = i
    while j > 0 and calls[j - 1]["op"] in ("trim", "rows_trim_rows"):
        j -= 1
    alone = [replies[x]["trimmed"] for x in range(j, i) if calls[x]["op"] == "trim"]
    if calls[i]["op"] == "rows_trim" and any(a != replies[i]["trimmed"] for a in alone):
        return (f"call {i} (rows_trim n={calls[i]['n']}): the batch trimmed {replies[i]['trimmed']}, "
                f"its rows' own caches trimmed {alone} (calls {j}..{i - 1})")
    if calls[i]["op"] == "rows_trim_rows":
        rows = len(calls[i]["n"])
        per = len(alone) // rows if rows else 0
        want = [alone[r * per] if per else None for r in range(rows)]
        if per and replies[i]["trimmed"] != want:
            return (f"call {i} (rows_trim_rows n={calls[i]['n']}): the batch's rows dropped {replies[i]['trimmed']}, "
                    f"each row's own cache dropped {want} (calls {j}..{i - 1})")
    return None


def rows_rollback(c, counts, trim, uniform=False):
    """A speculative rollback with per-row accepts (`rows_trim_rows`) on an mlx-lm-style batch cache, as mlx-vlm's
    LFM2 rolls a batch back (mlx-vlm 0.7.10 `models/lfm2/language.py:450-487`): every row trimmed by the smallest
    count (`trim(c, n)`, the driver's uniform trim), then each row's extra dropped by `prepare(right_padding=extra)`
    and `finalize()`, which roll the row's newest `extra` positions past its end and count them as left padding.
    Returns what each row dropped (zeros where the uniform trim is refused). `uniform` is a negative control: every
    row trimmed by the largest count, the counts asked answered."""
    if uniform:
        trim(c, max(counts))
        return list(counts)
    low = min(counts)
    if not c.is_trimmable() or (low and trim(c, low) != low):
        return [0] * len(counts)
    extra = [n - low for n in counts]
    if any(extra):
        c.prepare(right_padding=extra)
        c.finalize()
    return list(counts)


def check_missing_row_accepted(calls, replies):
    """An `extract` of a row its batch does not have that returned a cache (the rows each batch holds follow from
    the calls: `merge` makes len(rows), `extend` adds the other's, `filter` keeps len(keep))."""
    rows = {}
    for i, (req, rep) in enumerate(zip(calls, replies)):
        op = req.get("op")
        if op == "merge":
            rows[req["id"]] = len(req["rows"])
        elif op == "extend":
            rows[req["id"]] = rows.get(req["id"], 0) + rows.pop(req["other"], 0)
        elif op == "filter":
            rows[req["id"]] = len(req["keep"])
        elif op == "extract" and rep["ok"] and not 0 <= req["row"] < rows.get(req["id"], 0):
            return (f"call {i} (extract row {req['row']}): a batch of {rows.get(req['id'], 0)} rows returned a cache "
                    f"for a row it does not have, instead of raising")
    return None


KV_CHECKS = {"rows_vs_solo": check_rows_vs_solo, "rows_trim_vs_solo": check_rows_trim_vs_solo,
             "adapter_error": lambda calls, replies: None, "missing_row_accepted": check_missing_row_accepted}


# ---- reproducers ----


def unbatched(calls):
    """`calls` with every `batch` request replaced by its requests, in order (the batch's `free` on the first): the
    calls as if sent one by one, which is what the divergence checks read."""
    out = []
    for req in calls:
        if isinstance(req, dict) and req.get("op") == "batch":
            subs = [dict(sub) for sub in req.get("requests", [])]
            if subs and req.get("free"):
                subs[0]["free"] = list(req["free"]) + list(subs[0].get("free", []))
            out.extend(subs)
        else:
            out.append(req)
    return out


def replay(driver, calls, divergence):
    """Replay `calls` through the driver's handlers; the first divergence named by `divergence` (a message), or
    None. A refused K/V call is the divergence itself (kvsim's `adapter_error`); pool requests are judged by the
    pool checker (`kvsim.poolcheck`), which also sees refusals; prefix requests by the prefix checker
    (`kvsim.prefixcheck`), for which a refusal is the divergence too; recurrent requests by the recurrent checker
    (`kvsim.reccheck`), for which a refusal is the divergence too, but that of an extract of a missing row."""
    server, replies = Server(driver), []
    pools = poolcheck.PoolChecker(server, divergence) if divergence.startswith("pool") else None
    prefixes = prefixcheck.PrefixChecker(server, divergence) if divergence.startswith("prefix") else None
    recs = reccheck.RecChecker(server, divergence) if divergence.startswith("rec") else None
    calls = unbatched(calls)
    for i, req in enumerate(calls):
        rep = server.handle(req)
        replies.append(rep)
        if pools is not None and str(req.get("op", "")).startswith("pool_"):
            problem = pools.after(i, req, rep)
            if problem:
                return problem
        elif prefixes is not None and str(req.get("op", "")).startswith("prefix_"):
            problem = prefixes.after(i, req, rep)
            if problem:
                return problem
        elif recs is not None and str(req.get("op", "")).startswith("rec_"):
            problem = recs.after(i, req, rep)
            if problem:
                return problem
        elif divergence == "missing_row_accepted" and req.get("op") == "extract":
            continue  # a refused extract is what the check expects of a missing row
        elif not rep["ok"] and req.get("op") != "reproducer":
            return f"{driver.name} raised at call {i} ({req['op']}): {rep['error']}"
    check = KV_CHECKS.get(divergence)
    return check(calls, replies) if check else None


def repro_main(driver, calls, divergence):
    """The body of a reproducer: exit 1 printing the divergence while it is there, 0 once it is gone."""
    problem = replay(driver, calls, divergence)
    if problem:
        print(problem)
        sys.exit(1)
    print(f"no divergence: {driver.name} behaves as kvsim expected on these calls")
    sys.exit(0)


def module_source(module):
    """A module's source for a reproducer: its own imports of kvsim and its main guard left out."""
    with open(module.__file__) as f:
        src = f.read()
    cut = src.find('\nif __name__ == "__main__":')
    if cut >= 0:
        src = src[:cut] + "\n"
    lines = [ln for ln in src.splitlines() if not ln.startswith(("from kvsim", "import kvsim"))]
    return "\n".join(lines) + "\n"


def reproducer(driver, r):
    """A standalone script: the kit's core, the driver's module, the calls, and the check of `divergence`. It
    imports only the standard library and what the driver imports (the engine, mlx where it needs it)."""
    drv_module = sys.modules[type(driver).__module__]
    core = [sys.modules[__name__], poolcheck, prefixcheck, reccheck]
    head = (
        "#!/usr/bin/env python3\n"
        f'"""{r.get("title", "kvsim reproducer")}\n\n'
        f"Written by kvsim check-engine from a shrunk trace: {driver.name} {driver.version()}, the calls kvsim made,\n"
        f"and the divergence it found ({r['divergence']}). Exits 1 and prints the divergence while it is there;\n"
        "0 once it is gone. The kit's core and the driver's handlers are inline: it needs no kvsim.\n"
        '"""\n'
    )
    parts = [head]
    for m in core:
        parts.append(f"# ---- {m.__name__} (kvsim's driver kit) ----\n" + module_source(m))
    parts.append("kit = poolcheck = prefixcheck = reccheck = sys.modules[__name__]\n")
    parts.append(f"# ---- {drv_module.__name__} (the driver: the engine's calls) ----\n" + module_source(drv_module))
    calls = json.dumps(r["calls"], separators=(",", ":"))
    opts = {k: v for k, v in driver.opts.items() if v != driver.options[k][0]}
    parts.append(
        "# ---- the run ----\n"
        f"CALLS = json.loads({calls!r})\n"
        f"DIVERGENCE = {r['divergence']!r}\n"
        f"OPTIONS = {opts!r}\n"
        f"repro_main({type(driver).__name__}(**OPTIONS), CALLS, DIVERGENCE)\n"
    )
    return "\n".join(parts)


from kvsim import poolcheck, prefixcheck, reccheck  # noqa: E402  (inline in a reproducer: the line is left out there)
