#!/usr/bin/env python3
"""mlx-lm 0.32.2: [adapter_error/rows_window_(prefill)] after 3 scheduler ops (kvsim seed 58)

Written by kvsim check-engine from a shrunk trace: mlx-lm 0.32.2, the calls kvsim made,
and the divergence it found (adapter_error). Exits 1 and prints the divergence while it is there;
0 once it is gone. The kit's core and the driver's handlers are inline: it needs no kvsim.
"""

# ---- kvsim.kit (kvsim's driver kit) ----
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
    driver's option): a filter's first kept row takes its neighbour's state."""

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



# ---- kvsim.poolcheck (kvsim's driver kit) ----
"""A small pool model that re-checks a block-pool engine's replies (protocol 2, `supports.pool`).

Part of the kit's core: standard library only, copied verbatim into every reproducer. `PoolChecker.after` is called
with each pool request and its reply as they are replayed; it keeps the model kvsim keeps (which sequence holds which
blocks and tokens, what each block was cached under: the `pool_alloc` / `pool_cow` / `pool_hit` replies and the
`pool_cache` calls), reads the engine's `pool_info` after the request (a read the checker adds; it changes nothing a
later request sees), and answers the first violation of the invariant it was asked for (a message), or None.

Check names are kvsim's: `pool_refs`, `pool_tables`, `pool_cow`, `pool_storage`, `pool_lookup`, `pool_refusal`, `pool_count`;
`pool` re-checks all of them.
"""

CHECKS = ("pool_refs", "pool_tables", "pool_cow", "pool_storage", "pool_lookup", "pool_refusal", "pool_count")


class PoolModel:
    """What kvsim knows of one pool."""

    def __init__(self, block_size, usable):
        self.bs, self.usable = block_size, usable
        self.tables = {}  # seq -> [block], as the replies gave them
        self.held = {}  # seq -> tokens the sequence holds
        self.regs = {}  # block -> {(prefix tokens, block tokens): {seqs that cached it so}}

    def count(self, block):
        return sum(t.count(block) for t in self.tables.values())

    def distinct_held(self):
        return {b for t in self.tables.values() for b in t}

    def free(self):
        return self.usable - len(self.distinct_held())

    def blocks_for(self, n_tokens):
        return -(-n_tokens // self.bs)

    def key(self, tokens, i):
        bs = self.bs
        return tuple(tokens[: i * bs]), tuple(tokens[i * bs : (i + 1) * bs])

    def fresh(self, block):
        """A block handed out anew (allocated or a copy): whatever it was cached under is gone."""
        self.regs.pop(block, None)

    def cached_under(self, block, key):
        return key in self.regs.get(block, {})

    def held_and_cached(self, key):
        """Blocks some live sequence cached under `key` and still holds."""
        return [b for b, regs in self.regs.items()
                if any(s in self.tables and b in self.tables[s] for s in regs.get(key, ()))]

    def cached_free(self):
        held = self.distinct_held()
        return sum(1 for b, regs in self.regs.items() if regs and b not in held)


class PoolChecker:
    def __init__(self, server, divergence="pool"):
        self.server = server
        self.want = set(CHECKS) if divergence == "pool" else {divergence}
        self.pools = {}
        self.info = {}  # pool id -> the last pool_info read

    def probe(self, pid):
        rep = self.server.handle({"op": "pool_info", "id": pid})
        if not rep.get("ok"):
            raise RuntimeError(f"pool_info refused: {rep.get('error')}")
        return rep

    def after(self, i, req, rep):
        """The first violation the request `req` (call `i`) and its reply `rep` show, or None."""
        op, pid = req["op"], req.get("id")
        for gone in req.get("free", []):  # pools kvsim dropped: the engine may have forgotten them
            self.pools.pop(gone, None)
            self.info.pop(gone, None)
        where = f"call {i} ({op}"
        for k in ("seq", "new", "n"):
            if k in req:
                where += f" {k}={req[k]}"
        where += ")"
        problems = []

        def bad(check, msg):
            if check in self.want:
                problems.append(f"{where}: [{check}] {msg}")

        if op == "pool_new":
            if rep["ok"]:
                self.pools[pid] = PoolModel(req["block_size"], rep["usable"])
                self.info[pid] = self.probe(pid)
            else:
                bad("pool_refusal", f"refused: {rep['error']}")
            return problems[0] if problems else None
        m = self.pools.get(pid)
        if m is None:
            return None
        before = self.info.get(pid)
        getattr(self, "_" + op, lambda *a: None)(m, req, rep, bad)
        info = rep if op == "pool_info" and rep["ok"] else self.probe(pid)
        if not rep["ok"] and op == "pool_alloc" and before is not None:
            for k in ("free", "refs", "tables"):
                if before.get(k) != info.get(k):
                    bad("pool_refusal", f"the refused alloc changed `{k}`: {before.get(k)} before, {info.get(k)} after")
        self.info[pid] = info
        self.check_state(m, info, bad)
        return problems[0] if problems else None

    # -- after every request: the engine's pool_info against the model --

    def check_state(self, m, info, bad):
        refs = {int(b): c for b, c in info["refs"].items()}
        held = m.distinct_held()
        for b in sorted(held | set(refs)):
            want = m.count(b)
            if refs.get(b, 0) != want:
                bad("pool_refs", f"block {b} has ref count {refs.get(b, 0)}, but {want} table entries list it")
        if info["free"] != m.free():
            bad("pool_refs", f"free is {info['free']}, but usable {m.usable} - {len(held)} held blocks = {m.free()}")
        tables = {int(s): list(t) for s, t in info["tables"].items()}
        for s, t in sorted(m.tables.items()):
            if tables.get(s) != t:
                bad("pool_tables", f"seq {s}'s table is {tables.get(s)}, the replies gave {t}")
            if len(t) != m.blocks_for(m.held[s]):
                bad("pool_tables", f"seq {s} holds {m.held[s]} tokens in {len(t)} blocks of {m.bs}")
        for s in sorted(set(tables) - set(m.tables)):
            bad("pool_tables", f"seq {s} has table {tables[s]} but is not live")
        seen = {}
        for b, ident in sorted((int(b), v) for b, v in info.get("storage", {}).items()):
            if b in held and ident in seen:
                bad("pool_storage", f"blocks {seen[ident]} and {b} share storage {ident}")
            seen.setdefault(ident, b)

    # -- per request: the model's change and the reply's checks --

    def _handed_out(self, m, seq, blocks, bad, what):
        for b in blocks:
            others = [s for s, t in m.tables.items() if s != seq and b in t]
            if others:
                bad("pool_tables", f"{what} handed out block {b}, which seqs {others} hold")

    def _pool_alloc(self, m, req, rep, bad):
        need = m.blocks_for(len(req["tokens"]))
        if not rep["ok"]:
            if need <= m.free():
                bad("pool_refusal", f"refused {need} blocks with {m.free()} free: {rep['error']}")
            return
        t = list(rep["table"])
        if len(t) != need or len(set(t)) != len(t):
            bad("pool_tables", f"table {t} for {len(req['tokens'])} tokens: want {need} distinct blocks")
        self._handed_out(m, req["seq"], t, bad, "alloc")
        for b in t:
            m.fresh(b)
        m.tables[req["seq"]], m.held[req["seq"]] = t, len(req["tokens"])

    def _pool_free(self, m, req, rep, bad):
        if not rep["ok"]:
            bad("pool_refusal", f"refused: {rep['error']}")
        m.tables.pop(req["seq"], None)
        m.held.pop(req["seq"], None)

    def _pool_fork(self, m, req, rep, bad):
        if not rep["ok"]:
            bad("pool_refusal", f"refused: {rep['error']}")
            return
        src = m.tables.get(req["seq"], [])
        if list(rep["table"]) != src:
            bad("pool_tables", f"fork gave {rep['table']}, seq {req['seq']} holds {src}")
        m.tables[req["new"]], m.held[req["new"]] = list(rep["table"]), m.held.get(req["seq"], 0)

    def _pool_cow(self, m, req, rep, bad):
        seq = req["seq"]
        old = m.tables.get(seq, [])
        needed = sum(1 for b in old if m.count(b) > 1)
        if not rep["ok"]:
            if needed <= m.free():
                bad("pool_refusal", f"refused with {needed} copies needed and {m.free()} blocks free: {rep['error']}")
            return
        t = list(rep["table"])
        changed = [j for j in range(min(len(t), len(old))) if t[j] != old[j]]
        if len(t) != len(old):
            bad("pool_tables", f"cow changed the table's length: {old} -> {t}")
        if rep["copied"] != len(changed) or rep["copied"] > needed:
            bad("pool_count", f"copied {rep['copied']}: {len(changed)} entries changed, {needed} were shared")
        self._handed_out(m, seq, [t[j] for j in changed], bad, "cow")
        for j in changed:
            m.fresh(t[j])
        m.tables[seq] = t
        for b in t:
            others = [s for s, tt in m.tables.items() if s != seq and b in tt]
            if others or t.count(b) > 1:
                bad("pool_cow", f"after cow block {b} of seq {seq} is still held by seqs {others or [seq]} "
                                f"(table {old} -> {t}, copied {rep['copied']})")

    def _pool_cache(self, m, req, rep, bad):
        if not rep["ok"]:
            bad("pool_refusal", f"refused: {rep['error']}")
            return
        seq, tokens = req["seq"], req["tokens"]
        t = m.tables.get(seq, [])
        for i in range(min(len(tokens) // m.bs, len(t))):
            m.regs.setdefault(t[i], {}).setdefault(m.key(tokens, i), set()).add(seq)

    def _lookup(self, m, tokens, blocks, matched, bad):
        if matched != len(blocks) * m.bs or matched > len(tokens):
            bad("pool_count", f"matched {matched} with {len(blocks)} blocks of {m.bs} for {len(tokens)} tokens")
        for i, b in enumerate(blocks):
            pre, toks = m.key(tokens, i)
            if not m.cached_under(b, (pre, toks)):
                under = sorted(m.regs.get(b, {}), key=len)
                said = "; ".join(f"tokens {list(k[1])} after {list(k[0])}" for k in under) or "nothing"
                bad("pool_lookup", f"block {i} of the answer, block {b}, was cached holding {said}; the query's "
                                   f"block {i} is tokens {list(toks)} after {list(pre)}")
                return
        k = 0
        while (k + 1) * m.bs <= len(tokens) and m.held_and_cached(m.key(tokens, k)):
            k += 1
        if len(blocks) < k:
            bad("pool_lookup", f"found {len(blocks)} blocks ({matched} tokens), but live sequences hold {k} blocks "
                               f"cached under this prefix (e.g. block {m.held_and_cached(m.key(tokens, len(blocks)))[0]}"
                               f" for block {len(blocks)})")

    def _pool_lookup(self, m, req, rep, bad):
        if not rep["ok"]:
            bad("pool_refusal", f"refused: {rep['error']}")
            return
        self._lookup(m, req["tokens"], list(rep["blocks"]), rep["matched"], bad)

    def _pool_hit(self, m, req, rep, bad):
        if not rep["ok"]:
            bad("pool_refusal", f"refused: {rep['error']}")
            return
        t = list(rep["table"])
        self._lookup(m, req["tokens"], t, rep["matched"], bad)
        m.tables[req["seq"]], m.held[req["seq"]] = t, rep["matched"]

    def _pool_evict(self, m, req, rep, bad):
        if not rep["ok"]:
            bad("pool_refusal", f"refused: {rep['error']}")
            return
        most = min(req["n"], m.cached_free())
        if not 0 <= rep["evicted"] <= most:
            bad("pool_count", f"evicted {rep['evicted']}, but at most {most} cached blocks were free (n={req['n']})")

# ---- kvsim.prefixcheck (kvsim's driver kit) ----
"""Re-checks a prefix-cache engine's replies (protocol 2, `supports.prefix`) from the calls and replies alone.

Part of the kit's core: standard library only, copied verbatim into every reproducer. `PrefixChecker.after` is
called with each prefix request and its reply as they are replayed. It keeps what kvsim knows: each prefix cache's
layers (`prefix_new`) and every sequence inserted into it with the K/V sent for it (`prefix_insert`: the model, since
kvsim derives position `p`'s K and V from `tokens[..=p]` alone, the same prefix has the same bytes in any insert).
After a `prefix_lookup` with `matched > 0` it checks the invariant it was asked for, and answers the first
violation (a message) or None; for `prefix_warm_cold` it sends the engine a `prefix_cold` of `tokens[:matched]` with
the inserted K/V of those positions (a read that changes nothing a later request sees).

Check names are kvsim's: `prefix_count`, `prefix_offset`, `prefix_warm_cold`, `prefix_model`; `prefix` re-checks
all of them. A refused prefix request is a divergence under every name.
"""
import base64

CHECKS = ("prefix_count", "prefix_offset", "prefix_warm_cold", "prefix_model")
ELEMENT_SIZE = {"f32": 4, "bf16": 2}


def first_positions(a, m):
    """The array `a` (`[1, H, L, D]`, the protocol's encoding) cut to its first `m` positions (axis 2)."""
    _, h, n, d = a["shape"]
    raw = base64.b64decode(a["b64"])
    row = d * ELEMENT_SIZE[a["dtype"]]
    out = b"".join(raw[(i * n) * row : (i * n + m) * row] for i in range(h))
    return {"dtype": a["dtype"], "shape": [1, h, m, d], "b64": base64.b64encode(out).decode()}


def differ(got, want):
    """Why two arrays of the protocol's encoding differ (shape, dtype or first element), or None."""
    if got["dtype"] != want["dtype"] or list(got["shape"]) != list(want["shape"]):
        return f"{got['dtype']} {list(got['shape'])} where {want['dtype']} {list(want['shape'])} was expected"
    a, b = base64.b64decode(got["b64"]), base64.b64decode(want["b64"])
    if a == b:
        return None
    size = ELEMENT_SIZE[got["dtype"]]
    i = next(j for j in range(0, len(a), size) if a[j : j + size] != b[j : j + size]) // size
    _, h, n, d = got["shape"]
    return f"element {i} (head {i // (n * d)}, position {i // d % n}, dim {i % d}) differs"


class PrefixChecker:
    def __init__(self, server, divergence="prefix"):
        self.server = server
        self.want = set(CHECKS) if divergence == "prefix" else {divergence}
        self.caches = {}  # prefix id -> {"layers": [...], "seqs": [(tokens, k, v)]}

    def after(self, i, req, rep):
        """The first violation the request `req` (call `i`) and its reply `rep` show, or None."""
        for gone in req.get("free", []):
            self.caches.pop(gone, None)
        op, pid = req["op"], req.get("id")
        if not rep["ok"]:
            return f"call {i} ({op}): the engine refused: {rep['error']}"
        if op == "prefix_new":
            self.caches[pid] = {"layers": [l.get("max_size") for l in req["layers"]], "seqs": []}
        elif op == "prefix_insert" and pid in self.caches:
            self.caches[pid]["seqs"].append((list(req["tokens"]), req["k"], req["v"]))
        elif op == "prefix_lookup" and pid in self.caches and rep["matched"] > 0:
            problems = self.lookup(pid, list(req["tokens"]), rep)
            if problems:
                return f"call {i} (prefix_lookup of {len(req['tokens'])} tokens, matched {rep['matched']}): " + problems[0]
        return None

    def lookup(self, pid, tokens, rep):
        c, m, states = self.caches[pid], rep["matched"], rep["states"] or []
        problems = []

        def bad(check, msg):
            if check in self.want:
                problems.append(f"[{check}] {msg}")

        source = next((s for s in c["seqs"] if s[0][:m] == tokens[:m] and len(s[0]) >= m), None)
        if m > len(tokens) or source is None:
            bad("prefix_count", f"matched {m} of {len(tokens)} tokens, but no inserted sequence begins with "
                                f"tokens[:{m}] = {tokens[:m]}")
        if len(states) != len(c["layers"]):
            bad("prefix_offset", f"{len(states)} restored layers for a cache of {len(c['layers'])}")
        for j, s in enumerate(states):
            if s["offset"] != m:
                bad("prefix_offset", f"layer {j} was restored at offset {s['offset']}, matched says {m}")
        if source is None or m > len(tokens):
            return problems
        if "prefix_model" in self.want:
            for j, (w, s) in enumerate(zip(c["layers"], states)):
                if w:
                    continue
                for name, sent in (("k", source[1][j]), ("v", source[2][j])):
                    d = differ(s[name], first_positions(sent, m))
                    if d:
                        bad("prefix_model", f"layer {j} {name.upper()}: {d} from the K/V inserted for "
                                            f"tokens[:{m}] (inserted with {source[0]})")
                        break
        if "prefix_warm_cold" in self.want:
            cold = self.server.handle({"op": "prefix_cold", "id": pid, "tokens": tokens[:m],
                                       "k": [first_positions(a, m) for a in source[1]],
                                       "v": [first_positions(a, m) for a in source[2]]})
            if not cold.get("ok"):
                bad("prefix_warm_cold", f"prefix_cold refused: {cold.get('error')}")
                return problems
            for j, (s, t) in enumerate(zip(states, cold["states"])):
                for name in ("k", "v"):
                    d = differ(s[name], t[name])
                    if d:
                        bad("prefix_warm_cold", f"layer {j} {name.upper()} (max_size {c['layers'][j]}): {d} "
                                                f"from the cold run of tokens[:{m}]")
                        break
        return problems

# ---- kvsim.reccheck (kvsim's driver kit) ----
"""Re-checks a recurrent-state engine's replies (protocol 2, `supports.recurrent`) from the calls and replies alone.

Part of the kit's core: standard library only, copied verbatim into every reproducer. kvsim sends every state value
with its writes (`rec_write`'s `states`: per array `[B, n, ...]`, the state after each step), so where each row's
state must be follows from the calls: `RecChecker.after` is called with each recurrent request and its reply as they
are replayed, keeps per cache id its rows' expected arrays (the last step written; none before the first write,
which reads as zeros), moves them as `rec_merge` / `rec_extend` / `rec_filter` / `rec_extract` say, keeps each
speculative block's steps (`rec_spec_start`, then `rec_spec_commit` keeps `accept[b]` steps of row `b`,
`rec_spec_abort` none), keeps a right-padded prompt batch's real steps (`rec_prepare`'s `lengths`: a write's steps
past a row's length leave it at its last real step, until `rec_finalize`), and judges the engine's reads (`rec_state`, `rec_rows_state`, `rec_rows_info`) against them.

Check names are kvsim's: `rec_state`, `rec_rows`, `rec_rollback` (a read of a cache whose speculative block was
just committed or aborted), `rec_missing_row` (an `extract` of a row the batch does not have that returned a cache);
`rec` re-checks all of them. Any other refused recurrent request is a divergence under every name.
"""
import base64

REC_CHECKS = ("rec_state", "rec_rows", "rec_rollback", "rec_missing_row")
REC_SIZE = {"f32": 4, "bf16": 2}


class RecChecker:
    def __init__(self, server, divergence="rec"):
        self.server = server
        self.want = set(REC_CHECKS) if divergence == "rec" else {divergence}
        self.layer = None  # rec_new's arrays and dtype
        self.caches = {}  # id -> rows; a row is one entry per array: its expected bytes, or None (zeros)
        self.spec = {}  # id -> {"init": rows, "steps": per row the step arrays written since the start}
        self.rolled = set()  # ids whose last change was a commit or an abort
        self.left = {}  # id -> per row the real steps its prompt has left (between rec_prepare and rec_finalize)

    def expected(self, raw, a):
        if raw is not None:
            return raw
        shape = self.layer["arrays"][a]["shape"]
        n = 1
        for d in shape:
            n *= d
        return bytes(n * REC_SIZE[self.layer["dtype"]])

    def after(self, i, req, rep):
        """The first violation the request `req` (call `i`) and its reply `rep` show, or None."""
        op, cid = req["op"], req.get("id")
        for gone in req.get("free", []):
            self.caches.pop(gone, None)
        where = f"call {i} ({op}" + "".join(f" {k}={req[k]}" for k in ("id", "row", "keep", "n", "accept") if k in req) + ")"
        rows = self.caches.get(cid)
        if op == "rec_extract" and rows is not None and not 0 <= req["row"] < len(rows):
            if rep["ok"] and "rec_missing_row" in self.want:
                return (f"{where}: [rec_missing_row] a batch of {len(rows)} rows returned a cache for row "
                        f"{req['row']}, instead of raising")
            return None
        if not rep["ok"]:
            return f"{where}: the engine refused: {rep['error']}"
        if op not in ("rec_state", "rec_rows_state", "rec_rows_info"):
            self.rolled.clear()
        if op == "rec_new":
            self.layer = {"arrays": req["arrays"], "dtype": req["dtype"]}
            self.caches[cid] = [[None] * len(req["arrays"])]
        elif rows is None and op != "rec_merge":
            return None
        elif op == "rec_write":
            self.write(cid, rows, req["states"])
        elif op == "rec_merge":
            self.caches[cid] = [self.caches.pop(x)[0] for x in req["rows"]]
        elif op == "rec_extend":
            rows.extend(self.caches.pop(req["other"], []))
        elif op == "rec_filter":
            self.caches[cid] = [list(rows[k]) for k in req["keep"]]
        elif op == "rec_extract":
            self.caches[req["new"]] = [list(rows[req["row"]])]
        elif op == "rec_prepare":
            self.left[cid] = list(req["lengths"])
        elif op == "rec_finalize":
            self.left.pop(cid, None)
        elif op == "rec_spec_start":
            self.spec[cid] = {"init": [list(r) for r in rows], "steps": [[] for _ in rows]}
        elif op in ("rec_spec_commit", "rec_spec_abort"):
            sp = self.spec.pop(cid)
            accept = req.get("accept") or [0] * len(rows)
            self.caches[cid] = [list(sp["init"][b]) if a == 0 else list(sp["steps"][b][a - 1])
                                for b, a in enumerate(accept)]
            self.rolled.add(cid)
        elif op == "rec_rows_info" and rep["rows"] != len(rows) and "rec_rows" in self.want:
            return f"{where}: [rec_rows] the batch holds {rep['rows']} rows; the calls put {len(rows)} in it"
        elif op in ("rec_state", "rec_rows_state"):
            row = rows[req.get("row", 0)]
            check = "rec_rollback" if cid in self.rolled else "rec_state"
            if check not in self.want:
                return None
            for a, (got, raw) in enumerate(zip(rep["arrays"], row)):
                want = self.expected(raw, a)
                have = self.expected(None if got is None else base64.b64decode(got["b64"]), a)
                if have != want:
                    size = REC_SIZE[self.layer["dtype"]]
                    at = next(j for j in range(0, min(len(have), len(want)), size)
                              if have[j:j + size] != want[j:j + size]) // size if len(have) == len(want) else 0
                    return (f"{where}: [{check}] array {a} {self.layer['arrays'][a]['shape']} differs from the state "
                            f"the calls wrote for this row from element {at}" + self.whose(have))
        return None

    def write(self, cid, rows, states):
        dec = []
        for s in states:
            b_, n = s["shape"][0], s["shape"][1]
            raw = base64.b64decode(s["b64"])
            per = len(raw) // (b_ * n) if b_ * n else 0
            dec.append([[raw[(b * n + t) * per:(b * n + t + 1) * per] for t in range(n)] for b in range(b_)])
        left = self.left.get(cid)
        for b in range(len(rows)):
            steps = [[d[b][t] for d in dec] for t in range(len(dec[0][b]))] if dec and b < len(dec[0]) else []
            if cid in self.spec:
                self.spec[cid]["steps"][b].extend(steps)
            if left is not None and b < len(left):  # the row's steps past its prompt are padding
                real = max(0, min(len(steps), left[b]))
                left[b] -= len(steps)
                steps = steps[:real]
            if steps:
                rows[b] = list(steps[-1])

    def whose(self, have):
        """Which cache row's expected state (any array) `have` equals: a row that took its neighbour's state."""
        for cid, rows in self.caches.items():
            for b, row in enumerate(rows):
                for a, raw in enumerate(row):
                    if raw is not None and raw == have:
                        return f"; it is the state of cache {cid} row {b} (array {a})"
        return ""

kit = poolcheck = prefixcheck = reccheck = sys.modules[__name__]

# ---- kvsim.drivers.mlx_lm (the driver: the engine's calls) ----
"""kvsim's K/V requests served by mlx-lm's own caches (oracles/PROTOCOL.md, "Decisions taken by the mlx-lm engine").

    PYTHONPATH=python oracles/mlx_lm/.venv/bin/python -m kvsim.drivers.mlx_lm [--plant prefix-short]

Every serial cache is mlx-lm's `KVCache` (`RotatingKVCache(max_size=W, keep=0)` under a sliding window), every batch
its `BatchKVCache` (`BatchRotatingKVCache`; made by the serial class's `merge`, grown by `extend`, shrunk by `extract`
and `filter`); reads take their mask from the cache before the write (`base.create_attention_mask`, as a model's
forward does) and attend through `mlx_lm.models.base.scaled_dot_product_attention`; trims go through
`trim_prompt_cache`. The driver only calls mlx-lm: it re-implements none of it and works around none of its bugs.

Prefix caches (protocol 2, `supports.prefix`; oracles/mlx_lm/README.md, "Prefix caches"): each is mlx-lm's
`LRUPromptCache()` (`models/cache.py`, the server's, with the server's default of 10 entries), keyed by one model
key. `prefix_insert`: a `KVCache` / `RotatingKVCache(max_size=W, keep=0)` per layer filled by one `update_and_fetch`
of all positions, then `insert_cache(model, tokens, caches)`; `prefix_lookup`: `fetch_nearest_cache(model, tokens)`,
`matched` = len(tokens) - len(rest) as the server counts it, the states of the caches it hands back (deep copies,
trimmed by `trim_prompt_cache` for a longer entry); `prefix_cold`: the same caches without the prefix cache;
`prefix_evict`: `trim_to(n_sequences=len - 1)`, one LRU step. `--plant prefix-short` (a negative control, hello's
`version` says `+plant:...`): every restored layer answered one position short, `matched` kept.

Recurrent state (`supports.recurrent`, `rec_prefill`): every cache is an `ArraysCache`, batched by its `merge`,
`extend`, `extract`, `filter`; a write sets each array as a model layer does, through the cache's own `make_mask`
and `advance` (`kit.rec_masked_write`), and a right-padded prompt batch is `prepare(lengths=..., right_padding=...)`
then `finalize()`, as `BatchGenerator.prompt` runs it (`--rec-prefill no`: none drawn). `--plant rec-neighbour`: a
filter's first kept row takes its neighbour's state; `--plant rec-pad-unmasked`: a write ignores the mask (a padded
row keeps its padding's state).

Two more K/V configurations (`--kv chunked|cachelist`; oracles/mlx_lm/README.md, "Chunked and list caches"):

- `--kv chunked`: every serial cache is a `ChunkedKVCache` (llama4's), `chunk_size=W` under a sliding window, else
  8192 (llama4's attention chunk, never reached by a run: the cache is then full attention). Each read calls
  `maybe_trim_front()` first, as llama4's forward does before its layers, takes the mask over the positions the cache
  holds from `base.create_causal_mask(L, offset=held, window_size=W)` (kvsim's sliding window, not llama4's chunk
  mask), then `update_and_fetch` and `base.scaled_dot_product_attention`. `state` is the newest `min(held, W)` of
  `keys_and_values()` (what the next read's `maybe_trim_front` keeps; nothing is trimmed for it). The class has no
  `merge` and mlx-lm batches none (`generate._merge_caches` raises): `merge` is refused. `--plant chunk-trim-over`:
  a trim that drops anything drops one position more than it answers.
- `--kv cachelist`: every cache is a `CacheList` of two caches of the geometry's class (as longcat-flash's
  `CacheList(KVCache(), KVCache())`): sub-cache 0 takes kvsim's `(k, v)` and serves the reads (mask from it, as the
  models take theirs from `cache[0]`), sub-cache 1 takes the same positions with K and V swapped, `(v, k)`, and
  serves `state`, `offset` and `rows_info` (swapped back), so that both sub-caches are checked and one handed in the
  other's place shows. Batches are `CacheList.merge`, `extend`, `extract`, `filter`, `prepare`, `finalize`; trims
  `trim_prompt_cache([cache_list], n)`. `--plant cachelist-index`: `merge` builds sub-cache 1 from the rows'
  sub-caches 0.
"""

BASE, CACHE = kit.load_modules("mlx_lm", ["models.base", "models.cache"])


class MlxLm(kit.BatchCalls, kit.RecCalls, kit.Driver):
    """mlx-lm's caches by the ids kvsim gives them."""

    name = "mlx-lm"
    supports = {"kv": True, "serial_trim": True, "rows_window": True, "rows_trim": True, "join": False,
                "rotating": True, "prefill": True, "prefix": True, "recurrent": True, "rec_prefill": True}
    options = {"plant": (None, "prefix-short", "rec-neighbour", "chunk-trim-over", "cachelist-index",
                         "rollback-uniform", "rec-pad-unmasked"),
               "kv": ("plain", "quant", "chunked", "cachelist"), "prefill": ("yes", "no"), "trim_rows": ("no", "yes"),
               "rec_prefill": ("yes", "no")}
    chunk_full = 8192  # llama4's attention_chunk_size: the chunk of a full-attention run (no run reaches it)
    model = "kvsim"  # the model key of every prefix-cache call (the server's `model_key`)

    def version(self):
        v = kit.package_version("mlx-lm")
        v += f"+{self.opts['kv']}" if self.opts["kv"] != "plain" else ""
        return v + (f"+plant:{self.opts['plant']}" if self.opts["plant"] else "")

    def hello_extra(self):
        return {"mlx": kit.package_version("mlx")}

    def __init__(self, **opts):
        super().__init__(**opts)
        if self.opts["kv"] == "quant":
            # mlx-lm 0.32.2 quantizes only full-attention caches and batches none of them (QuantizedKVCache has no
            # `merge`; RotatingKVCache.to_quantized raises NotImplementedError): quantized serial caches only.
            self.supports = {"kv": True, "quant_only": True, "serial_trim": True, "prefix": False}
        elif self.opts["kv"] == "chunked":
            # serial only: ChunkedKVCache has no merge (every merge kvsim draws is refused, `op_merge`)
            self.supports = {"kv": True, "serial_trim": True, "rotating": True, "prefix": False}
        elif self.opts["kv"] == "cachelist":
            self.supports = dict(self.supports, prefix=False, recurrent=False)
        elif self.opts["prefill"] == "no":
            # the K/V runs of protocol 1 (no right-padded prefill drawn): the classes of the protocol-1 report again
            self.supports = dict(self.supports, prefill=False)
        if self.opts["rec_prefill"] == "no":
            # recurrent runs without right-padded prompt batches (`rec_prepare`): the runs recorded before them
            self.supports = dict(self.supports, rec_prefill=False)
        if self.opts["trim_rows"] == "yes" and self.opts["kv"] == "plain":
            # per-row rollback (`rows_trim_rows`, `kit.rows_rollback`), full attention only: BatchKVCache takes right
            # padding alone (cache.py:938-957), BatchRotatingKVCache only with a prefill's `lengths` (:1243-1254).
            # Opt-in, so the recorded runs stay as they were.
            self.supports = dict(self.supports, rows_trim_rows=True, rotating=False)

    def op_new(self, r):
        self.geometry = g = r["geometry"]
        w, q, kv = g.get("max_size"), g.get("quant"), self.opts["kv"]
        if q:
            c = CACHE.QuantizedKVCache(group_size=q["group_size"], bits=q["bits"])
        elif kv == "chunked":
            c = CACHE.ChunkedKVCache(chunk_size=w or self.chunk_full)
        elif kv == "cachelist":
            c = CACHE.CacheList(*(CACHE.RotatingKVCache(max_size=w, keep=0) if w else CACHE.KVCache() for _ in "01"))
        else:
            c = CACHE.RotatingKVCache(max_size=w, keep=0) if w else CACHE.KVCache()
        self.handles[r["id"]] = c
        return {}

    def op_window(self, r):
        c = self.handles[r["id"]]
        k, v, q = kit.arr_in(r["k"]), kit.arr_in(r["v"]), kit.arr_in(r["q"])
        w = self.geometry.get("max_size")
        if isinstance(c, CACHE.ChunkedKVCache):
            # llama4's order: the front trimmed before the layer writes; the mask over the positions held (its
            # sliding window of W, or causal), built by mlx-lm's `create_causal_mask`
            c.maybe_trim_front()
            mask = BASE.create_causal_mask(q.shape[2], offset=c.offset - c.start_position, window_size=w)
        elif isinstance(c, CACHE.CacheList):
            c[1].update_and_fetch(v, k)  # the second stream: the same positions, K and V swapped
            c = c[0]
            mask = BASE.create_attention_mask(q.transpose(0, 2, 1, 3), c, window_size=w)
        else:
            # the mask of the cache before the write, as a model's forward builds it
            mask = BASE.create_attention_mask(q.transpose(0, 2, 1, 3), c, window_size=w)
        keys, values = c.update_and_fetch(k, v)
        out = BASE.scaled_dot_product_attention(q, keys, values, c, scale=r["scale"], mask=mask)
        return {"out": kit.arr_out(out)}

    op_decode = op_rows_window = op_rows_decode = op_window

    def op_trim(self, r):
        c = self.handles[r["id"]]
        trimmed = CACHE.trim_prompt_cache([c], r["n"])
        if self.opts["plant"] == "chunk-trim-over" and isinstance(c, CACHE.ChunkedKVCache) and trimmed:
            c.trim(1)  # a negative control: a trim drops one position more than it answers
        return {"trimmed": trimmed}

    op_rows_trim = op_trim

    def op_rows_trim_rows(self, r):
        uniform = self.opts["plant"] == "rollback-uniform"  # a negative control: every row drops the most
        trim = lambda c, n: CACHE.trim_prompt_cache([c], n)
        return {"trimmed": kit.rows_rollback(self.handles[r["id"]], r["n"], trim, uniform)}

    def state_of(self, c):
        """The K/V the next read attends, oldest first: the first `offset` columns of a KVCache (the planes of a
        QuantizedKVCache); the newest min(offset, W) of a RotatingKVCache in temporal order (its `_temporal_order`);
        the newest min(held, W) of what a ChunkedKVCache holds (`keys_and_values()`; all it holds without a window);
        a CacheList's sub-cache 1, K and V swapped back."""
        if isinstance(c, CACHE.CacheList):
            out = kit.state_reply(c[1], self.geometry)
            return {"k": out["v"], "v": out["k"]}
        if isinstance(c, CACHE.ChunkedKVCache) and c.keys is not None:
            k, v = c.keys_and_values()
            w = self.geometry.get("max_size")
            n = min(k.shape[2], w) if w else k.shape[2]
            return {"k": kit.arr_out(k[..., k.shape[2] - n :, :]), "v": kit.arr_out(v[..., v.shape[2] - n :, :])}
        return kit.state_reply(c, self.geometry)

    def op_state(self, r):
        return self.state_of(self.handles[r["id"]])

    @staticmethod
    def offset_of(c):
        return (c[1] if isinstance(c, CACHE.CacheList) else c).offset

    def op_offset(self, r):
        return {"offset": int(self.offset_of(self.handles[r["id"]]))}

    def op_merge(self, r):
        rows = [self.handles.pop(i) for i in r["rows"]]
        if not hasattr(rows[0], "merge"):  # ChunkedKVCache: refused as mlx-lm's batching refuses it
            raise NotImplementedError(f"{type(rows[0]).__name__} has no merge: mlx-lm batches none "
                                      "(generate._merge_caches: \"does not yet support batching with history\")")
        batch = rows[0].merge(rows)
        if self.opts["plant"] == "cachelist-index" and isinstance(batch, CACHE.CacheList):
            # a negative control: sub-cache 1 of the batch built from the rows' sub-caches 0
            batch.caches = (batch.caches[0], rows[0].caches[0].merge([c.caches[0] for c in rows]))
        self.handles[r["id"]] = batch
        return {}

    # ---- prefix caches ----

    def prefill(self, p, k, v):
        """Each layer's cache as a prefill of those positions makes it: one `update_and_fetch` of all of them."""
        caches = []
        for w, kl, vl in zip(p["windows"], k, v):
            c = CACHE.RotatingKVCache(max_size=w, keep=0) if w else CACHE.KVCache()
            c.update_and_fetch(kit.arr_in(kl), kit.arr_in(vl))
            caches.append(c)
        return caches

    def op_prefix_new(self, r):
        self.handles[r["id"]] = {"lru": CACHE.LRUPromptCache(), "windows": [l.get("max_size") for l in r["layers"]],
                                 "geometry": {k: r[k] for k in ("heads_kv", "head_dim", "dtype")}}
        return {}

    def op_prefix_insert(self, r):
        p = self.handles[r["id"]]
        p["lru"].insert_cache(self.model, list(r["tokens"]), self.prefill(p, r["k"], r["v"]))
        return {}

    def op_prefix_lookup(self, r):
        p, tokens = self.handles[r["id"]], list(r["tokens"])
        caches, rest = p["lru"].fetch_nearest_cache(self.model, tokens)
        if caches is None:
            return {"matched": 0, "states": None}
        short = self.opts["plant"] == "prefix-short"
        return {"matched": len(tokens) - len(rest), "states": kit.layer_states(caches, p["geometry"], short)}

    def op_prefix_cold(self, r):
        p = self.handles[r["id"]]
        return {"states": kit.layer_states(self.prefill(p, r["k"], r["v"]), p["geometry"])}

    def op_prefix_evict(self, r):
        lru = self.handles[r["id"]]["lru"]
        before = len(lru)
        lru.trim_to(n_sequences=before - 1)
        return {"evicted": before - len(lru)}

    # ---- recurrent state (ArraysCache) ----

    def op_rec_new(self, r):
        self.handles[r["id"]] = CACHE.ArraysCache(len(r["arrays"]))
        return {}

    def op_rec_write(self, r):
        """Every array set to the state after the last step, as a model layer assigns `cache[i] = new_state`, then
        `advance(n)`; under a right-padded prompt (`rec_prepare`) through the cache's own `make_mask`, as mlx-lm's
        recurrent layers take it (kit.rec_masked_write)."""
        kit.rec_masked_write(self.handles[r["id"]], r["n"], r["states"], self.opts["plant"] == "rec-pad-unmasked")
        return {}



# ---- the run ----
CALLS = json.loads('[{"geometry":{"dtype":"bf16","head_dim":4,"heads_kv":1,"heads_q":1,"max_size":3},"id":1,"op":"new"},{"geometry":{"dtype":"bf16","head_dim":4,"heads_kv":1,"heads_q":1,"max_size":3},"id":2,"op":"new"},{"op":"batch","requests":[{"id":1,"op":"offset"},{"id":1,"op":"state"},{"id":2,"op":"state"}]},{"geometry":{"dtype":"bf16","head_dim":4,"heads_kv":1,"heads_q":1,"max_size":3},"id":3,"op":"new"},{"geometry":{"dtype":"bf16","head_dim":4,"heads_kv":1,"heads_q":1,"max_size":3},"id":4,"op":"new"},{"op":"batch","requests":[{"id":1,"op":"offset"},{"id":1,"op":"state"},{"id":2,"op":"state"},{"id":3,"op":"offset"},{"id":3,"op":"state"},{"id":4,"op":"state"}]},{"id":5,"op":"merge","rows":[1,3]},{"id":5,"lengths":[1,2],"op":"rows_prepare","right_padding":[1,0]},{"op":"batch","requests":[{"id":5,"k":{"b64":"Kj6QPg4/Iz9zv+U9dj9VPw==","dtype":"bf16","shape":[2,1,1,4]},"op":"rows_window","q":{"b64":"gL89P4a+mr43v5e+Ab/qPg==","dtype":"bf16","shape":[2,1,1,4]},"real":[1,1],"scale":0.5,"v":{"b64":"y751v+O9qz4Yv8E+FT8bPg==","dtype":"bf16","shape":[2,1,1,4]}},{"id":2,"k":{"b64":"Kj6QPg4/Iz8=","dtype":"bf16","shape":[1,1,1,4]},"op":"window","q":{"b64":"gL89P4a+mr4=","dtype":"bf16","shape":[1,1,1,4]},"scale":0.5,"v":{"b64":"y751v+O9qz4=","dtype":"bf16","shape":[1,1,1,4]}},{"id":4,"k":{"b64":"c7/lPXY/VT8=","dtype":"bf16","shape":[1,1,1,4]},"op":"window","q":{"b64":"N7+XvgG/6j4=","dtype":"bf16","shape":[1,1,1,4]},"scale":0.5,"v":{"b64":"GL/BPhU/Gz4=","dtype":"bf16","shape":[1,1,1,4]}}]}]')
DIVERGENCE = 'adapter_error'
OPTIONS = {}
repro_main(MlxLm(**OPTIONS), CALLS, DIVERGENCE)
