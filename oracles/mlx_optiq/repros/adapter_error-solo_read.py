#!/usr/bin/env python3
"""mlx-optiq 0.7.7: [adapter_error/solo_read] after 2 scheduler ops (kvsim seed 9)

Written by kvsim check-engine from a shrunk trace: mlx-optiq 0.7.7, the calls kvsim made,
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

This module, `kvsim.poolcheck` and `kvsim.prefixcheck` are the kit's core: they import only the standard library (mlx
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


class Server:
    """One driver behind the protocol: `handle(request) -> reply` (hello, reset, free and dispatch)."""

    def __init__(self, driver):
        self.driver = driver

    def handle(self, req):
        """The reply to `req`, its arrays' bytes written (`materialize`). An array that fails to evaluate makes its
        request's reply a refusal, as if its handler had raised (a `batch`'s other replies stand)."""
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
    for line in stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except ValueError as e:
            reply = refusal(e)
        else:
            reply = server.handle(req)
        stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
        stdout.flush()


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
_OWNER = [None]  # the index of the `batch` request being handled (None outside a batch)


def arr_out(x):
    """The protocol's array of `x`; its bytes are written when the reply is complete (`materialize`), so that
    every array of a reply (a `batch`'s included) is evaluated in one graph evaluation."""
    a = {"dtype": _codec()["names"][x.dtype], "shape": list(x.shape), "b64": None}
    _PENDING.append((_OWNER[0], a, x))
    return a


def arrs_out(*xs):
    return [arr_out(x) for x in xs]


def materialize(reply, owner="all"):
    """Evaluates the arrays encoded since the last call (those of one batch request, `owner`, or all) at once and
    writes their base64 bytes; returns `reply`. Raises what the evaluation raises, the arrays left pending."""
    mine = [p for p in _PENDING if owner == "all" or p[0] == owner]
    if mine:
        _codec()["mx"].eval(*[x for _, _, x in mine if x.size])
        for _, a, x in mine:
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
    """The last call, a `rows_trim`, against the twin `trim` calls right before it."""
    i = len(calls) - 1
    j = i
    while j > 0 and calls[j - 1]["op"] == "trim":
        j -= 1
    alone = [replies[x]["trimmed"] for x in range(j, i)]
    if calls[i]["op"] == "rows_trim" and any(a != replies[i]["trimmed"] for a in alone):
        return (f"call {i} (rows_trim n={calls[i]['n']}): the batch trimmed {replies[i]['trimmed']}, "
                f"its rows' own caches trimmed {alone} (calls {j}..{i - 1})")
    return None


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
    (`kvsim.prefixcheck`), for which a refusal is the divergence too."""
    server, replies = Server(driver), []
    pools = poolcheck.PoolChecker(server, divergence) if divergence.startswith("pool") else None
    prefixes = prefixcheck.PrefixChecker(server, divergence) if divergence.startswith("prefix") else None
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
    core = [sys.modules[__name__], poolcheck, prefixcheck]
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
    parts.append("kit = poolcheck = prefixcheck = sys.modules[__name__]\n")
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

kit = poolcheck = prefixcheck = sys.modules[__name__]

# ---- __main__ (the driver: the engine's calls) ----
"""kvsim's quantized K/V requests served by mlx-optiq's own caches (oracles/mlx_optiq/README.md).

    PYTHONPATH=python oracles/mlx_optiq/.venv/bin/python -m kvsim.drivers.mlx_optiq \
        [--cache batch|rotating] [--plant quant-row-copy]

Every run is quantized (`supports.quant_only`): `new` carries `quant` (`bits`, `group_size`). A full-attention
serial cache is optiq's `MergeableQuantizedKVCache(group_size, bits)` (`optiq/runtime/kv/batch.py`), whose `merge` is
`BatchQuantizedKVCache.merge`; a batch is that `BatchQuantizedKVCache` (grown by `extend`, shrunk by `extract`,
`filter`, trimmed by `trim_prompt_cache`, readied for a right-padded prefill by `prepare` and ended by its own
`finalize`). `--cache rotating` adds sliding windows: a serial cache is then optiq's
`RotatingQuantizedKVCache(max_size=W, keep=0, group_size, bits)` (`optiq/runtime/kv/rotating.py`), and runs stay
serial (`supports.quant_rows` false): optiq quantizes the batch path's full-attention layers only and leaves
sliding-window layers at full precision (`install_batch_kv_quant`, `batch.py:420-437`). The driver first installs what
`optiq serve` installs (`patch_rotating_to_quantized()`: optiq's SDPA dispatch and its GQA mask fix;
`batch_rotating_merge.install()`). Reads take their mask
from the cache before the write (`create_attention_mask`) and attend through `mlx_lm.models.base`'s
`scaled_dot_product_attention` (its quantized path: the caches have `bits`). States are the planes of the positions
the next read attends, in temporal order (`kit.state_reply`).

`--plant quant-row-copy` (a negative control, hello's `version` says `+plant:...`): after every decode of a batch of
two rows or more, row 1's newest K column takes row 0's packed words (a quantized row written at another row's
column).
"""

BASE, CACHE = kit.load_modules("mlx_lm", ["models.base", "models.cache"])
ROT, BATCH, ROT_MERGE = kit.load_modules(
    "optiq", ["runtime.kv.rotating", "runtime.kv.batch", "runtime.kv.batch_rotating_merge"])
ROT.patch_rotating_to_quantized()
ROT_MERGE.install()


class MlxOptiq(kit.Driver):
    """mlx-optiq's quantized caches by the ids kvsim gives them."""

    name = "mlx-optiq"
    supports = {"kv": True, "quant_only": True, "quant_rows": True, "serial_trim": True, "rows_window": True,
                "rows_trim": True, "join": False, "rotating": False, "prefill": True}
    options = {"plant": (None, "quant-row-copy"), "cache": ("batch", "rotating")}

    def __init__(self, **opts):
        super().__init__(**opts)
        if self.opts["cache"] == "rotating":
            self.supports = dict(self.supports, rotating=True, quant_rows=False)

    def version(self):
        v = kit.package_version("mlx-optiq") + (" rotating" if self.opts["cache"] == "rotating" else "")
        return v + (f"+plant:{self.opts['plant']}" if self.opts["plant"] else "")

    def hello_extra(self):
        return {"mlx": kit.package_version("mlx"), "mlx-lm": kit.package_version("mlx-lm")}

    def op_new(self, r):
        self.geometry = g = r["geometry"]
        q, w = g["quant"], g.get("max_size")
        if w:
            c = ROT.RotatingQuantizedKVCache(max_size=w, keep=0, group_size=q["group_size"], bits=q["bits"])
        else:
            c = BATCH.MergeableQuantizedKVCache(group_size=q["group_size"], bits=q["bits"])
        self.handles[r["id"]] = c
        return {}

    def op_window(self, r):
        c = self.handles[r["id"]]
        k, v, q = kit.arr_in(r["k"]), kit.arr_in(r["v"]), kit.arr_in(r["q"])
        mask = BASE.create_attention_mask(q.transpose(0, 2, 1, 3), c, window_size=self.geometry.get("max_size"))
        keys, values = c.update_and_fetch(k, v)
        out = BASE.scaled_dot_product_attention(q, keys, values, c, scale=r["scale"], mask=mask)
        return {"out": kit.arr_out(out)}

    op_decode = op_rows_window = op_window

    def op_rows_decode(self, r):
        out = self.op_window(r)
        c = self.handles[r["id"]]
        if self.opts["plant"] == "quant-row-copy" and c.keys[0].shape[0] >= 2:
            col = int(c._idx) - 1
            c.keys[0][1, :, col, :] = c.keys[0][0, :, col, :]
        return out

    def op_trim(self, r):
        return {"trimmed": CACHE.trim_prompt_cache([self.handles[r["id"]]], r["n"])}

    op_rows_trim = op_trim

    def op_state(self, r):
        return kit.state_reply(self.handles[r["id"]], self.geometry)

    def op_offset(self, r):
        return {"offset": int(self.handles[r["id"]].offset)}

    def op_merge(self, r):
        rows = [self.handles.pop(i) for i in r["rows"]]
        self.handles[r["id"]] = rows[0].merge(rows)
        return {}

    def op_extend(self, r):
        self.handles[r["id"]].extend(self.handles.pop(r["other"]))
        return {}

    def op_rows_info(self, r):
        offsets = [int(o) for o in self.handles[r["id"]].offset.tolist()]
        return {"rows": len(offsets), "offsets": offsets}

    def op_extract(self, r):
        self.handles[r["new"]] = self.handles[r["id"]].extract(r["row"])
        return {}

    def op_filter(self, r):
        self.handles[r["id"]].filter(r["keep"])
        return {}

    def op_rows_prepare(self, r):
        # as mlx-lm's BatchGenerator.prompt does: only when some row is padded (BatchKVCache.prepare, inherited)
        if max(r["right_padding"], default=0) > 0:
            self.handles[r["id"]].prepare(lengths=r["lengths"], right_padding=r["right_padding"])
        return {}

    def op_rows_finalize(self, r):
        self.handles[r["id"]].finalize()  # BatchQuantizedKVCache.finalize: the three planes rolled alike
        return {}

    def op_rows_state(self, r):
        return kit.state_reply(self.handles[r["id"]].extract(r["row"]), self.geometry)



# ---- the run ----
CALLS = json.loads('[{"geometry":{"dtype":"f32","head_dim":128,"heads_kv":2,"heads_q":4,"max_size":null,"quant":{"bits":6,"group_size":128,"mode":"affine"}},"id":1,"op":"new"},{"geometry":{"dtype":"f32","head_dim":128,"heads_kv":2,"heads_q":4,"max_size":null,"quant":{"bits":6,"group_size":128,"mode":"affine"}},"id":2,"op":"new"},{"op":"batch","requests":[{"id":1,"op":"offset"},{"id":1,"op":"state"},{"id":2,"op":"state"}]},{"id":1,"k":{"b64":"HLBQv4otbT9QkeI+MsEqP87NHz8Ie8e++IYQPgiDG79sh0g/AARMO5Smob7oS1G/YFVKv0CZgT2ODik/IIUmPihPdj92eCm/glZIP5j5ZL84R2q/qKWKPmDtHr8AZYq8NMyavozTE7/68AO/cjR8v4CCP76wKO090mcpPzyrrr4gCEg/ZFSUPuRQJj/Usl0/9FpuPyAivz58SPU+hCzvPoAvtLzixXA/tE/bPhANbr/Y2ru+lEDpPjhVLL7wFlW+SHRCPtiLxb4iQFy/ugQqv+CMFr6ABR2/XKhEP6zsU7/AuPG+NIOCPkCIJT1KQB2/IJN/vk4vPT9McSI/EJT+PagpHj9uLw6/BLnHvtgOfL6Q/kY+QDs1vwCj87zMb7O+5FunvrjjCj5Moi6/GmdJP0Ddpj0geTQ+wI1Ev0DvKT2KRTq/cN+1PZw+dz8wjSW/DC4Dvyzm0L66J20/8klVPxQy3z7UBV0/3rZOv5BoFL6o8B0+wtdRPzAXCr9UblC/VhYeP8AnWT8Y+Bu+yjduv3DQkz7G/ie/BMUYP/jxwz7Ur/c+KKV3v95VI7/EneI+UosoP+hwIj+A0Zu+KJrgvpZFLT8A0Iy+JqNJP1wKWT9sEW2/3HHBPqBriL2Q6+69oJFkvwwmKb+Ah6G+luovv6CL377uLVM/tKBiP8iBEb+Oym8/gHB/PWZgGD+g1Vk9gNqivjCZRT5kml6/ONdovhAeXD/ilCE/tFElv1iEcL8A+He60mcev9Axzb1Edio/gncJv8ipM78yAha/yEq2PupYLb/YmUk+sDObvg5eBL9MADY/xMK8PlogMT/KzEU/gHuqvdLfez/01h+/oLQaPzCmuj2Adic/AJAyuwxWEr+QbWe/EBtEPtSOGD94OH4/NJUEvzBZZj7c46u+pApdv2wwdL/skU0/+EjRvgACaD0YAXo+yDgDvgC+y7v4un6+IMtav1a+YT9Akwg/zMHrvlCx2r0Y45s+yJUJP6yFfT84yAO/HgBLPxBYlj2gLmY9wF3RPrwSib7yLVa/AO7Nu4wXX7+2pBc/Huk2v6B7hD7QqKo+cHMSPmSPGD8gvAe+zvcoP8Y3ZL9YZYE+9JAvv65LOb/QJH++sBzbPiwvWD+g6Ca/IJZ2P8qTIj+Uvgq/CAiUvuCMRz8soEG/gAV3vVAfaL6UJiu/6F4TP0J4ST/mcUE/oBe9vjiGtD7S7WI/wGL6vlxB/j5IHKc+9PVgvxpGc78qFQE/xJb+PproCb+wwGm+7MAHvzSkV78q1Hs/FIfYPjQEMT/w9Fa+jpFtv5CYsL1yPXc/pP2uPtDlcr6yMHA/vBzBPhBHJL/+10q/UkV0vy6NYL/w46Q9Cmo+v6B5hr4MNcE+kL/3PWiRKr4ynXO/CPkMv2BMAj5AyjS+dtllP0jfCD7QIWQ+vFCAvvhCEj9uKDw/2GhhPmAPHb4o4Q0+kgMYvyj0Xb+uoDS/KGZBv/jvR77kqNM+mgtfPzgStD7yR2i/wCFwv8Qs4L4qYAW/0LG7PiYmfL/4Jp0+YI9DvnSBXj+Sf02/AOoZu1YwYj/E/iY/GKUHvly62j6Mj2q/wnBBv2r/Bb8gTE+9irwQPzDMAL6QEAI+EIX9PaSIbz+SVDK/itg+vwIjdr+yggm/CIobv7Dceb4m0BM/yj9svyahA788xvm+oBqGvkDafr1gUS6+thh7P/yvSr80JJ2+pHIAv9bXaj9gtXW9Tp4HPzh4HL5w4vQ9AAEDP6Bp2z4k+eQ+UFjNvTholj7uBkG/qnt1P4CYnj4sii6/cOcev2DBIz18lQ0/TOkRP6z8jb6uGjq/LI9vPwCqKL0UX7i+wNiVvtD74z16Q3E/8IW/PcpiNL9Q8Fc/CLGOvnD4AT5ethe/WLxyv5Dc8b0QPrE9SK5uP7RtxT4AKC++0IDYvrg9b7/cHga/nrJyP0DAd784YxS+iKQFPlj/UT+4Gre+GA1+P+g3F75Uf34/XBTBvpijDD/AJPm80FT1PZbsB792sRG/YPTMPahzrL70lqi+GOElvvDO6z2SOxi/hPhkP5iaIz6c2nK/wKKIvL45Sj+Y2vK+8MAPv5Svfj8cLgW/3hQ6P8LpHD84KPQ+DDIiP3RodT9uxwO/MOyzPgAEiru2Bxy/wLX8PFTV+74gO38+hOxKv+z4AD9wuRi+Lq5wP6gUFj404aK+yIFdP0CYTr6qWBQ/gqZrv5weGL/A4fk8vAWkPoANG75A6VA/KPJIPioZUz+IgZG+mhROP4rXRz+MhJy+EMeVPgqQUD9QLM4+1usqPwyg9r4ASjo9QBQnPYSspL6wZuk+QP0Lv+ppFz8EU40+KC6ovqC7iD5SOj6/DJc5v6aWA79g9P+9wKoDvr7BDL+wnbc9XBwov9A7dL5gnA2/FAg/P+gUw76UARw/4OEJPkTiq752qzm/YONLPUxQ1r6upxk/bK4SP2we0r4Ukz4/ZrITv+ic974A5xQ+3J1+P7jI0b5QlZC+yrMsv8RERr/aZVw/EEgzvuCjLT9ehD6/4KE5voavDz+oH4M+wM+4vWK1Er8QcIO9EAC1PrLBa79ANyC/pPLVvjIkMD84IAi+KpZAvx4rS78Alpi7OB9nPvwG1L6Ay9Y+pA8kP4DB2L5c0Hu/dCfcvoxcnz4WdxY/jvwbv7RRN78qtgy/Lo8HP8QThD6ADWa+MPqnPqgbDr4Ar9S9wL8CP6AAKr8YvSK/VjkHvzARS7/gZXa/cAXFPQhi8r6wy849uPrhPvTwRz/O2Qy/1itMv+5ie7/SV2y/JM8MP1xFAr8OfEa/uDy3vlyNp77gpOg+vmVsv5TcLT+qDzS/YGa/Prh+Jj5oZ1U/Mswqv1D+pL5oaBW+XP8XP8BDNj9ICCi/fAxeP9p/XL/OyhU/kBGCvaIUR78A/oo+lnV1vzZdfj/0Cla/nmY8P5q8PL+mMUK/sNXVPZK0RT/OTTM/UAbMPtjezj5gZO694GW3PogCbr/I7J++Cho0vxLZUj+AOSE+lGNsv8C9sb4Mhta+8F0rv4iHQ78Axq28MIphPja6BT+8VEm/CGQ3P8hSUr+A+iS9HHnjPq4tPr+gzlA/aOtJPsxKcb9YmrO+oCJaPoANrDxIn1G/IOpzv2wuAj/wXA6+4MP5vRLCPr9G32m/6PvoPmQyk760aO0+Ku8SP9BdCr94C1A/UAwivgiXST9iJA2/frdOPzAKTr5W+1a/gE1FvNJ3HD8AQLI7rgclP5qpIb9MhY2+bBYmP5AGUj5wjOq+aNWlPnqdLT+IHwA+wBmSvhzVob6uAz0/QitMPyAt8D7ALuQ84IcLvjjaHL7A1R49tHR8P4zduT5YRfG+FJYiPwCf9T7IdDS+ygEUv3BvIL4SiDi/ACmMvoCfHr28H9I+TFgGP0A4uDxgYpM+MOIfvrL1Kb9M3Fw/QCiivei1pj4AAHi2LGd/vxJCET+wVv2+0E9QvnhZHT4IS5i+CvJdPzj4F76smi6/BoFCv7ITTL/aAzi/0PDGPgglJj9ebXy/kHWqPZDhDD7gOeE+yGo/P87CAD+GzyY/SA5hv0h5x758gqg+cmhDv8zPyz4A8Xk/BFqZvgwIuD7qNRQ/jO7UPvifQz9opzE/QP+lPHC8cb/0gD6/cI6ePQyMGb8o3WA/AtcpP6y/a7+SKHE/rC+svsDOSD8MU+e+EGJXPzic2T6oYWE+QPugPq7HLL+6Al4/PPmAPpJqND9cvlm/6HP5vsjsND/YkZi+bmo9P2BS0z4e/ES/pBWtvl5/b7+wnSu/nIBOv+CL/r5svoA+ALrSPCiGkD4whBa/oDcpv2AqSb46LSe/4JYaPXQbDj+YUSs/aA1tvuDTj75O3Qa/jDOJPiCgYb6ydhW/ILgvvwwpbj/gxDA9plYgP/jMEz7w8c49ljwuP+Dr0b3Aezc9UCX/PnJmKr8A828/4Lv4Pbw5+76gWtc9uI17P4wmRj+YeWa+KO7HPqQROT/s2fa+ynoKvwBGZztQ4UY+mMy+vhhhKT7aKT8/oCpgvbiLrT4AV2O+2KJGPkAOar7EuCw/5hokv0yhmL6++ji/vIMePyieQj+S0VO/QFL3vbRz8b40ZMc+","dtype":"f32","shape":[1,2,3,128]},"op":"window","q":{"b64":"SPShvkQMMb/IWBq+kM2Bvpjf7j70FGo/wOZovzYQcj907k0/dO/VvtQk1b54eQK/gEdMvpiDRD+w95O+AK9DvYpiXj9Ml/y+MEzgvpClvb4Y+hy+mt1aPxJreb8sIHw/EjVWP9hzjz68jVW/EBjJPgDETL74SEO+8Nm0vqDPa75MMl8/+lgFvxi8ND744O++2GmEvtBhxT6q80w/1B0QP7DHv70uDWs/oBGxPQI5cj+q3Hs/CIz/Ph4FIr9OPhu/YP7evmC0Ob58fAY/5BkGv8DRfz0Y03a/mAouPzDc977KiR2/0KZlvujsvL78zXA/gOhlvADWQTvoTyS+hl5Nv+yoir7knrm+XPESv2Cabj/w/Kk+ZEVBvxBezj7ILRS+IPDFPsTCAb8MsE+/cl9zv5qVXD8ImF2/gGdHPH5JI79qmks/2JSqPpAMdL6qfhy/cotAP8CZGT/uyga/Sn5ivwx//75wxGk+wPtXv4h9OT8IwyQ/8nMsPwBbXjzY0hg/fANOv5AN+77KFVS/zMzLvsBKLz8YqM4+2E4IPwDq/b4Mulu/SsJDPxAhQz84lFi/hO2jvr4ZQL/wW5c9YOevPQ5Ier9QLq89+K6uvkRVT7/gFuk++F7HPlB15z4Cklo/rMMAPwD/5T5KtRc/lANNP8C+Q73A3l89+LBlPkT/v75MeBC/TEddP24oHz+QBLu9gLEtPpzaST8QvDq/+hIdPyB0O78UNr4+cLQ3vnyTEj8MxnG/4FteP9DTsT4Yu+q+aFr+vtSQ+b6mAQq/IFeUPsBmM72AS/08xK7cvsCC/Ly4U+G+llY7v6gBWj6mZl0/sD36Pny5Zj/A8Tg+NPEwPwAZ275m+SM/TBdrv2Arcb8mrXU/ePjtvuI4d7/yK3I/4KdaPWgNJz8EVVk/lGDhPqgFhz7ANNm9IFsivuStzT7E3B2/HJtKP3iRFb9EmuI+aGmSvvQNGj8wEx6/8GveviSTFD9Ag0M+4M6HvpI5KL/kPCw/mBZTPwCwBTvWYjc/9FgyvyQ0sj44txA+NjILP9D3+L48W9k+sL09vwhmIb5KvWm/uCN5PgBUaTu0Hoc+qCJQPwgu7b6895o+/JeivmiySr5QOBy+QLuRPm7yJr+QhZU+tpQFP6ZWWL+G8VU/AGsavCR82z7EoJk+QpRSP5DF9r3uWwW/zjcpP+79ZT/wKRO+6A33PkAn3byETbO+gPwDPXJafD+w7d8+DKjSvqh7675Af1u+XuECv1Ctlz2QSNQ9FDOAvv5YQ7+Uu16/aOmlvnBa/D1owsS+hCuaPlDSn74clUW/EKcPv4R0g74Kowe/RoEwP1ImUz/43W+/oITbvio3cz88GE6/5KVIP8bodL80FwS/GGhBvsCCdj1+iTu/QCztPTDbgD0M3sG+1scfv3a3c7/4esG+FppKP6pFM788l+8+dsZeP6hPur6IAzG/pI1zv46JHb/Umts+lKh5P+CpSb4EjJC+INt4vri9hb4AVW68VNMmvyYoQL94+7W+QPtMPsI+W79EX5q++MAPP85KLr/UdvC+6NwFP/BQoD44pyC+Yh5av8Bn/j1wumm/XpIEP2DtMj5qOCC/QLFovgbtOL/Ady0+/COwPhz6fL/gfYI9pC6KvlIidb/wG7s9AKLlvNZeHr9A9N8+jNjMvrR5y77mNh4/oIuJvqCdLD3g0de9iENovrDvKT50URi/nGoOP3CP0z2A7ls9mIb9PjhsQr5AdS2/0IlTv9iDKT4O0Ao/tPvvvry1Bj/o+YI+PHvbPoANKb0ADkY7vJJiP1DZ/r3ICPe+/AEDvwjyJL+41ao+UAv6vTTD+74QPhM+fnEvPyAkUD2kp/u+qPYpPoDV1jzAAG6+YgJRP0oBHL++Rn8/ZB4IP/RdNb92kUc/TC3tvtgSxL7Mtr6+uAv0vtBXPr+M274+INXavlgldj9w5H4/CKQFPm7Mdb8AdFi/ADt3vqw9Vb/A3FK/pF6nPmByzb54gsy+lppHPzRVCL9ieg4/gDUqPwgCDD9AGZ6+msFDP9JndT+EWs0+Ti9xPzwW/T5oUhq/AphevyR1wz56sR0/iLIaPgBOpLwwezi+1vtAvzYGI79sRYQ+CBU/v5zi/b6AeCu9QDAoPwidlb5Uu0w/SvU9PyoTEz8EQAY/hvsyPzw/pz5MJnK/SFdxvhCzij1Yv3I/HLmzvngxTz7WlCU/fpZDv/hVx75WZXO/hnEzP9KIHz8AuoC+2C2fvgaVaT+I6Xg/PMW1vsBXvTzMvqU+9JFBP9CgFr6oCvS+CG8Gv4ATHr9UF5g+7JtsP8jtWz7oGJ++6uUQvwB9fD/cMfu+PCVAvyZcRD/kSSq/AIjuO4AE2zyAhF89pgxTv5YOYL90DCi/OPgmvmJIO79+O1M/0GlwPvAWCD8c5BU/fGn5PkorWj/wdwu/1l1aP/Jga792KDc/4u1vP4CW57w4+Jy+sio9P8iGMz7acio/DK40v5KgMD9IAb8+hJ/EPgBENj0wJry9Nss0v6Bzpz22tx6/5FfWPqJGUT/A8hu/TrlDvyD5Kz3uiQU/NDLhPtCLIr+oXLe++lYjPzYxTD+I3i2+wjR2P05cWT+s/Qw/pgp1P97fMj+KGnI/UKs9v/DfXj727zE/Jq1WvwCl3jvoyQG/qKQePxDzOT4QEeA+sLxsv2Q5GL+A+ky/QNnwvWC9cr9cems/CIdCPuhjWr7oj6O+uC4GPqStM7+o4IO+RDNZv2CCUT98jnw/JPq4vh7TM7+Q7ri+qIubPtpHOb/UtXq/wFipvpzfZT/Gzja/2AdyvrimqD5mWFc/yJ7ovlA+070gkBY/XkojP4isyL6yJmU/eLyGPvYOLb98vl0/7Ml+P9pHcz/qeyU/eNHMvlwNVj/gZc+9uABNv4B8y72oiCA/vLPNPgBuNr7Ib3Y/2pUyv35qBz+U/MY+Zj4Zv/AUKL8gGHM+DuJHP4TXgD7oXO++OtZ8P9j80j6GUCG/+AfCvgApjr2MJh8/xOhUv5Krfr/cF7q+jO1TP9yWFT8AFsQ77D5DvzRX7z6ABGM/2PQZPtpCNr9S3GW/fnRhv3RI4T7SMGG/3qhav+BXD78AVng+OPtnvwArDD9OTFq/yClrv8TnCT9ydBk/8AIoPqCa+T00tMi+HDZfP+StmL7smp4+EHsRv3ipPb6wLh0+0JTQPXDFkj7gS3Y/UsVKP4jtGT8MIW+/uOY6v1DHlb6A6t68aFTEPmB2Ir7AUXC9ri1KP9Dv9r3klK++wBAgvwDc2D0aGki/FgtWv17hID+YcwQ/qOPBvoAfkb6AqNO+UjETvxDhEz6iJi6/iIJJvsBvGr1g5hM9DBrDvoTnr74m4nu/tOALP1i0o77U+Yi+wL2MPGiKAz+AvDK+hF+evkCHbj/wt1E+Xg1Hv2LMPD+QysW9yOlFvkRa5T5KNA+/ADB+vzzx3j4iTAW/OAbUvuS+xL5wxEw+7KPevnQ9Mj+gd1c+ZPsWPxRo8r404es+QOyOveSlxr44QoS++KvrvkQObT882ry+NlV8P8QSvT7AuLq9/AjZPkBWGb0i6Ta/zGUZP+w+tz7owUA+/jUBv8YuQT/89hk/YDgBvQQc5D5wjdm+ALzFPsCSZL28r20/DDU4v6oac7+A7nG8OGWnvvAEwr44whE+SEjYvigisL5iZUC/MH86v1yjrT4YG5++0ETGvubsKj9o1ne/oLsjvWzX/L727i8/YINGPcJ9Oz9MKW2/8GbMvZCEsL1AyLu+FtoGv0QqgL7MvV0/yAivvgbZcz+gcPK9qApbvpRHqz78qxe//FZ6v97dCT/G4yi/YESMPbwfmD5oZma+8BFlv37mF78cGSg/0M7OvpD6Gb4qlxS/AGckPNjCCr6Yeky+pqw0P3ifaj+I63M/KpVnvxBT170i4Dy/al0evxhfwb4YXoC+/OQBvzDRd786Pyy/SNR8v4ZsXD9g4P0+Dpp5v+AeG78Qr/e+ro56P9DeF7+A8lK9xJa3PoDBB76sM5S+wHQ6P5jWVT+Qsdq9OHAsPri/sL7gD1I/YtIAv3TIQr9yVwG/FkNxP2IbHr/0e3S/LOBiP7j4pD6YngG/RPJ7P2o3d79w4x2+qAgaviCD2T56Wxs/qDYWPpB4OL8CnQM/mmdkv6BVIb+eyi+/yuxkv6ZlV7/cIto+QOQ8P4AuBT1+6VU/GhZ6v3xbkT5qHzY/1vcWPzAqyj6E6CQ/HOzQPnyMC78oBcu+apISP8A1OD9iPHA/Yt4PP7z3iL4iHyw/APATP4AbK7/oaHo/kAOZvoYjJj+wU8K+VqQcP+YSbb+w3Hq/Bu5lP8D7yDzAQ0O+8rsLv/jUQj6gaui9gtZJv8zD6z5s/Bu/4M3cPfg/ib4MJW6/6HMiP+y1qL7kCp8+4E9DPxBrLr5YTSW/eLehvgzV5b4w236+COLQvvi3uL52ZAC/kkwtP1oYfr9G2U0/aOBGPpDh977E5iq/+jRWv+gqE76ujyM/YHvwPi4Oeb8QDga/bIadvoICSD/IPDO+yJQiPlAbxT6AcxG/eFISvlwJDj+4zu2+ckosvwD5Dr30GXm/GA5Cv6D2pT7YRfc+qHr5PrB+bj+w/RW/AGHGu/y0pj5IId0+gLgqvNAcRz6k+L++VCwBP6xu0j7QFty+hMBIvzx1+T6yN0+/Yv4EP2olRz/iEEg/qFVQv1iXKT9g2Rc90AulPtoMUz/0onK/Sid4v/CFNT/qq3A/ADrUuwBM17pYFbc+SDBpPqxIpb5OzQG/fmgivyxedr98cUQ/enkLP9zAUr/Ayz29QBq7PhyTib50jSI/HPqHPgD8KDxAjPA+8gR0PwjS97525G6/qC7zviwLET/UuG8/9vgnv/QrfT/ewSe/QpkLPyqWYD/QJjI/sJDlvSA0ob6iU1A/8BWHvjgmxz54/xa/8Bk8PvSHQL9scUS/ygVqPwDwdr7Aqtm9jqRWvwhBID4Asmg8vOIhPzi/Mr5coWE/OPR5vgiITL5AV7G+hlNZP4JuWz9YCby+7JTkPmQw676kc58+Kv4Yv6BSm77AxnI/cJWIPmDA3b5gRpM9msM6vzjgOb52g02/ZJc8v3TeOT/oYKa+5Fm3PkBE2zzo9UA+YLxCPwyxBT8kMoE+xMoGP9T4Kz++hk2/vFLHPiD0Sz/wSDE+yP12P8ZdYz9sMNq+MLMwPta9f78QAGc+JIPEPlC/7b4a2n6/hiZIvy7bCD+Emp4+mFYkPpBmW7+gDNK9hOwTP+hu6b7E9/a+QP6TvMhs3r5oIhU+lrkyv7g46r5CYwQ/4F0LPabTGL+Yy1s+8EF8vkLLbz/waTG+7s9rvzJfWj8aUCu/EPW5vbSlIb8elAk/YBs3PxD+1D3isjW/NKbYPnhUOb5E0xq/WNZ8vsogFj/w+xq+4DCNPgxTM7+4+7Y+4EcfPYDEfT8ABAy8fA+Kvir4IL+8YIA+DIXYviQ6+D5sxbA+sIHuvvyqKj8oqSG/mjoMv4DjGj+MzvS+wFtZPQ7QDb/oaj0/3Dkjv2wgyb7ABQQ+WqImv6JRZr/w+hq+DPa4PhgAHz7GvG2/CLiAvvjnaz80C2Q/AN92PAogSr9wO9q+IA29vnBhdj62kG2/4owSv0yO4r6kbMU+uD5kP5ZsaD/AAxS/OPK5viQQPr/gMjI/vvcmPzxgJj/wtxe/VH+Mvrqva7+4V1k+GoUePzAXnb3IrUe/IHrCvYxWhT60maQ+kDlvvywqcr+osBW+9mVXP1ByDL/QVyQ/CMCVvngYIj+oP4G+ADAkviYvXr9Q2ZS9QN0kPcAwsjyy71e/cqB5P6bLLT/wqci9TFVhPwjQXz5CQR2/dNmHvgB97bsIJDQ+6DymvlRNiD5AazU9ULHSPlAyaD+89l0/nrYkv+ZwYD+upjY/ELXmPeSdeD8wNbG9dttqv8ycXz/k4pS+PudJPyyLpj7qbxi/uGbMvjQT4L4IwgQ+XBsbP/Awrb6wZDc+ks8Iv3ZWHT+c2fo+IBLPvvAl/L1Czha/2K9rv4inID+8G2c/+uopv0IoaL+ADJu95jIlv6D+gz18GPY+COiaPgoPKL82IFQ/HipFv4QU9T5KjmQ/wDvwvn4mL7+UKHS/1Gy0vkTIk76Awha/fCr2PkrjfD+g+lu+dqwSP6JCZb8UuC2/4sxEv7JHGT8Asmk91JaTPub7Jj94gj0+fBCIPtbVYT9oxpc+ildcP6CoyD2sgLg+iHKNvoBoa7/OK38/wN/CvNxEWz+KHTU/NlpKvwThk75A9j49AHzZuiB9Mj/g+ww95og4v4ptdb+AO2s+OM6KPlAZwD2ch2U/0OiBPtCFID9olUQ+TJaRvjBE871IFFK+0E3oPvS5ob6OXXG/lhgkP9QLpb6QX+M+XHU1P7wjv76YcwS+QE/avMBInL5wrby+BttLvziuoL7s5x2/4KIQvsCdwz5Mu8I+1FgSP1L/AL9QT9W9MP/kvvjyKj8U6as+zOgcP0wPib50OSq/gBm3PQqrRD/g3Ks++hEZPwQfVD+giVi9YHVTPj5BYL9wnKm9ag5Qv07sR7/I2mG++FvHPihyc77AA6E9PN5Gv/qGOj+00ES/QIzmvGBVXz8+cCi/lGd8v2bzDr8A6Lc8NIA6v97uUj8Qqyc/jKwBv3S5vD7Q2YU+YOQrP2CbIj8wKpO9CLO9PthkC744kzm+QucWv7xJrj4YM8m+5oYjv4C+ir4Qg2c+LIVVP+i0Dz843IA+KBCmvthcFT/8a9a+QGpoPRTCNL/2F2S/FghSP+7pXr+QX4W+xMS4vlhtKr+o6yU+gAFwP3LfVz9wQ7A9dLSXvmiPHT9g1jG/mD8eP0pMLj8+dFa/COGBPthOAz7WFmI/YkNUP8DDIT8gYCu9Qm8NP/65Yz8kicc+ciwtvwCNtbvMpQi/CLRqPhDR7D1Sinc/yEdZPhBgM75q0Cm/wAFzP+Qger9Qu1w/Lqhov5rKKT+W2Xs/9F5fv4DGsD6YtCo/dGqWPsAGfj76qga/8mN8P4TWXb8gc4g+2KY4PhDAvj7sE9U+XrAfvyTuer/0RWo/TFSBvszO975cNoc+thcFP1h8XL92iHG/TBqZPp4dO79wv2U+0O02vvhQv75Yu42+ZDiwvoR0Wb+CiRo/zFddv3J+cL9g0sC+TKlPP+rsIT+ULo6+dNN7v351Yb98S62+GE59P6BDOD/sRZy+MIYhv5iFn76QP3s/KDnGvn75Dz8gjD09sM+3vcRWXb8cpQg/PPm8Ppjytb6Ogkw/2HAhPuT7ur7SBic/WKSIvuhqbD+IOCG+wNNpvlZAWL/U9Z6++q8tPxiOwr7IZKq+JK2LPtAWfT+K3zw/tNwBP2r2DT9gKp296P2DPpa9Pb/wK/69cL6xPn5jPj/UvII+xASPPpCN7b6O8Ec/AD35PUQqA798ar2+oLopv+hg4r5kEye/WmBCPwAQ4L0Q7AO/qJbHvmR/GD+sbLC+Dv4pP8J8ab+aD2W/vIsyPyh0tj7S2Hm/cMu2PTgdeL40zkS/8OodPvDlij2Qab8+5CyAvjS1hL4um2g/4P3QPuT2iz5qZG+/JoM/v3jkUD82exE/OslNP0SBmj6Qfaw+zAHdvkDiDT66YkS/srERv3LbND9QMcs+YB5CvSwFpj4Agh07usFLPzB3GT5ojoQ+VpVEv+zMVr+Wqha/rn82v8gCrr6qtFW/IJbCvmjNiD5ClV2/QGscvVoWbT9ws26/6HxMPyihA7/osKM+Qp5BP6AgOj4iIFU/PkooP/ybKr9gEUM/MjkVvxitQb68y9q+1HZMPyAG1z5MtzG/oJwVvtaDfL9YjGA+pP+qPmKkKj9iRgQ/hANOvwCZ/bwCGzW/qEcaPqh5br7+ojC/+CFsvwCQLbpQYDk+ggcfvyClK7/UrcU+4oowv3Z9aj9mLWw/yHKLPtyd/j7Is0++8k1cv2A98z7s4+c+kLFEvkDH9LyQg9W+AJOSPEBS8z5y3Uy/2ME5P4DmI740AMg+ID2jvZ4XEz9QPOu9iDAovqRjFj+woTu/lkI2v4oxPL8AREm8snN/v1xi9L7ikVy/Dih4P24KRb8Ymwm/eO0EPg5+bj/ScyS/YOB8vWykhT6gXZ09stQpP3QIYr/g0Qs+dLYbPzpBaT/KwBk/qMQOviq8A7+Q0Qu/YDMfP/QpeT+gozk/st9kv3Rkdz/AUKG+","dtype":"f32","shape":[1,4,3,128]},"scale":0.0883883461356163,"v":{"b64":"+rhKv6Dytj6YO0g+ZAmXPkC3F72UxoQ+fqAkv4YpKL+ofli/nrZkv7zSsr7cbdA+AJwmvuA2Mb9q032/JJ+qPmjPYb7uV1o/VJZdv8Cl877YMju/IMZBv7zE4D4cEH2//PZgP/hh6z5+018/wLTqvRZRIj8Y3OS+xP3evtz+4T6A7l++hr12vx70Rj8MEJm+sDjIvgiVfD6asCm/uGQdPkhZgr4oea++HtMCP1ibJT+wCho//AZtv8AlxT3gJwI/tC4yP9Ti0z6AFa49WCXJPqzsXj/gVYw+EBp9P9wqcL8888m+TglEv9opX7/4mdI+oNELP9jBIL6CvWM/HL91P+B0PD6oYcq+4Aj3PuASYr9ydFW/ujl/P47SWb9Mi4Y+PGINP9w59j5IIum+kgYrv+j7wT60MuA+oP7fPTwV9z5oxDS/sDdEv5bcKz9AseI+Dn9lPxjpb7/opWq+hBlQvzg+G7+sbmI/yNJUvnjJsr4UhEC/2JK3vjDoAD6EBzU/sNzPPZB4Xr4wB0o+dKo4P3haQ7/A75w8UH2KvZz2pb4iLz4/oMWfvYraJr9k3nS/NJx2vzDEu73aaA+/mIAoPjDtkz0IQfI+MPLpPoCbWD1gWZm+qpE5P4CaNz4c/G4/bK+GPqANMb1QCJ++tCqEvnAuyr3QK+Y+1PRIP1CJ9j12/0a/pJNmP5ipMb4i+36/pt1pP/jnp75cGbQ+TMrvPnhkr768RdQ+2KGmPtghbL/QEhY/aNbRPvgPRz+Kkle/GPoAP9jjJz4Qawe+Xn1Zv2CLbT8IFzO+ONwiP4T/3z6wDps+2BT9vpY3A7+weBe/grYUv7Af/z5aVgc/HHZQPwC43ruA/iy8dEWXvkZvHb9o3g0/KC/LvsAx+L6AZw0/wB30PEA0hj58aOo+3OUZP2D/J77Ob3m/IDBgPxbxHD+KFz2/Vnt8v6j4yj6onHw/zHhov0amOT+YH8C+WkVIPyR1oL5QldW+CNwoP5YVDz8Y+Js+4Ih6vcoYOz+2Ck4/5LfxvrDyFL5MnU+/cB2wvlDkcz7iDQc/vFHaPtJJbL8smSC/6lsvP0zz8r74aeC+tAg0v6g6Dr60z/2+NHMqvxqFZz8wjRq/gG8uPjTBJD94w6w+4Ht6vqg3kj7QjmW/4E33vnDPWD6oQFS+6HJdPpoAOD/0aJu+1E6NvnyufL9iKl2/aANmvoQ3SL+4xOm+MNcIvsAnFL+KWTG/vIsGPwCo6D4W400/1F1JP5IOCD+axhG/4J5QPnQIu774wTq+DPCSvijeCb9AgGe9tIfUvniRzr56kxI/piRxv4BPSTyKex8/lOilPsodOz94Gjc+fKzmvnAM1D68Vl0/rll3P/z4Gb+qgxI/XPvPPtzmrr6y70C/nAQuv7YuQr9sNGS/Cp8Zv8BWn7wg0Eu/zHq/PkCcIj7M+rK+MLBMvjY5QL9Yb0w+aMrYvkgLTr+O63W/YNSoPWIhRT/AODK/hKAhv0TlXz+2EQ4/sGh6vrCwuL5ACcQ94G1gv4KQWr8AMyy9cOv1PuBcyL04HCW/Znh/P3jb9b6e1Ra/tGa1PgCsf7tmfTo/EAHuvkIDZb/MT/Q+QBauvNpDIr+yAE6/tsV5v5Axv75OH04/9hlLv3xm7T7yO1s/AOkFvIDkJz8u0yu/irk9v1KfSb/ctns/MmJpvxi9CL+Ilro+5kMfP74zeT9QgEg+vFJAvySKiT7AIiA9emhCP4jM6T6UtR8/sAPPPqrTQj9Ae1I/2ADAPhjLHz/gVS6+gp1dP5JWcj/GA3g/yJf9vsbNa79G4G2/EM1Wv1DBbj7gVAa+GKctvyKfDD84WJE+WMQDvpgMPL/OQkg/UvFCP3Tzi744402++HfYPvg95r7m9jI/EGZmv1AuMb4kT2y/wDnOPUgGWj9ojhG+3GcnvzbjF7/Edyq/WE5IvyijwT7GP1o/HKj/vgg0Wb58VAc/BL+dPn6JJz+Aq2u8JHZLv0BJpD0exnu/7I/sPnp5Fr8Inno+uHFLPh5Uer+2Ry8/DGLFPnQdXz8y5V6/VN98vyCVtj5kQmK/+vIkv2RNZL9gu2Y+2O7XPtwg2j7KzC0/gkJ1P4hsZL5QuWG+UOwzvm6ncj8Ozy2/UHfdvaw/zT66ASC/LKz5PtCJmz64fTc+yOPQvkCeRL/wRfu+oJA1P8ywWz8I6Ui+oGIuvjjsTz/wd6C9iGEIPiCeXD16ahK/luYgP8QpHr+0dvS+BiMXP9QKjz50K9I+JhwOPxxEnj6UteS+SENQvghoaT7qyHc/SNIvPoQcyD4sny0/+CEpPwg7YL6omkG/2B12P3A15T60xKW++BE1vlgUt760Td2+jAcDP7TTVL8Qp6s9/NGfPqRzVj84D8+++nFHv+ByMb+sP+M+MHz7vrC7nz1QJ/++8Eh4v7h8rj5sJQW/Bidsv9zdwr5uCGo/AG5avkgfkL7geOw9AL0lPkoIHT/QQVm/VJLHPtaVCz+4NRc+/G+JPlKXfL8sGN6+GLGHPqJnHj8i/H+/8GjMvYj4L78oHYE+LLw5v7iocb+QYWy/4F27PngB/b7AoNU99iJUP8ge0r5o5AE+OAxmP1CtFz64BgG+qOkRPijruj6IJgA+drgeP/QLkr72lyS/YAvXvSbwdr8MNBg/4C4lvUCvAL0KWws/AG6TvtRAXb8e/H2/5D+/vsBHNr/A+Au/4LPqPkD2RL0SVWi/yGIXvlIEbz9UXXA/WqUuP9SLyL4+zBa/IM5sPQhOxr7AfSY+JG0rPxR7nL5AFGQ9Yhsuv1JqNz+ARlQ9ZGjLPoQtSz/YzBk/LF1+PyKsTr8ASHm/DNpEPz4/TT8gPEw+7CP4Pug7D74OGCe/oBbmvrBba74UpgS/KMzyPhSAnr6Mhhw/qAQLvgB22r5EbNo+uGluvxDYtj1gGGu+uJ0jv247FT98pyS/0CDGPZ4MV7/eFxU/fqUkv/Amf7/U1Cm/9Jtxv6CjYD/EFq4+OLp0PjpKe7/05Pw+6sUCv0zF3j7EmbA+dlY+vwAfgLtAVdA9AGqkvMTLE79yaD0/+hIbv4Bd9r1o9g0+3McpP5g5Az5oHaM+/KmePnQKPb/sGxA/SAFtP/jLMT6MBeg+NINpP/BrWz4sbAQ/xiMrv0D0lL0QEJe9BgAkv4BYFj7owyQ/mA1ovyzfz74KlXq/AMJ7v/YpWz/Iii2/NDgaP+bZYr+g6w8/ojEIv1RSCL+gexK9ZrNWP+jzVT8gMXy/gh8gP747FT+gI7C+MKK/Pub2fb841xQ/SPk5PjYSJr9gE/A+gEJSPUBksD4QGZG9NKM6v/QcIj9mE0A/tDffPn6BEb9ktky/9KVKvwCWsz5oCGq+MHQePowEuL7QPgY+UL1cvi5CP78MAEK/ykMIP5p8LT9ycB4/MK8BPpKCar+4qwq/LFwrvwThzb70Dnc/qpsyP2g7Lb8sLYO+TFBbP/D3Aj5sams/YClVvjAbNb4wwUq/gFDBvCApU75YP6g+RvonP1BQjj0QA+A+Ppwqv8SvKj+Ix2q+0C3TvqpNEb/40ks+GFKqvuCFUj1A82S+juoKv4awQr+KLQ+/on9jP9QW4j6W8wk/GOYzP4iOVD+I70Q/BlkeP5xjND9kHPe+FFOfvsBImjyW6Ck/gFBHPAYkGz+8j2E/4FJ6PkSHgD4QGqY+oAgRP4iPzz7YG8W+3D00v2hD2b5oiO4+EMwbPsQv7T7UDm6/VKzcPgzz0b6wtxE+mCExPrKuNT8AZHc9YFsxPrBqrj2sS/y+1mVwP7otJb8ypxW/yOt/vwAEFz12Qz0/XJ29PogpC77853c/oPpQvXgsNz7WsB2/Dq0EP2qWUz8Acn2+YCWqPtQQwD5UHpo+fBQMP/hrgr7IjEi+YPAnvhSnqz5QENw9qBJ1PwarVL9sXn+/UPUWP5rEXr86D0A/UKHcPeyyR7+2Ule/oJ0zv5DV1j6gxgU+crY/v7Anhj0WgTW/GB1SP8LBJD+AMP0+oH0rPizPpz5aShQ/mP7LPriVKj4Qctc9rmZRP7ohYb/4WzU+SBiqPvw+tz6gKA+9xkZVP9r/Ij+oiC+/WAVDP1JBWL+EgNg+","dtype":"f32","shape":[1,2,3,128]}},{"id":2,"k":{"b64":"HLBQv4otbT9QkeI+MsEqP87NHz8Ie8e++IYQPgiDG79sh0g/AARMO5Smob7oS1G/YFVKv0CZgT2ODik/IIUmPihPdj92eCm/glZIP5j5ZL84R2q/qKWKPmDtHr8AZYq8NMyavozTE7/68AO/cjR8v4CCP76wKO090mcpPzyrrr4gCEg/ZFSUPuRQJj/Usl0/9FpuPyAivz58SPU+hCzvPoAvtLzixXA/tE/bPhANbr/Y2ru+lEDpPjhVLL7wFlW+SHRCPtiLxb4iQFy/ugQqv+CMFr6ABR2/XKhEP6zsU7/AuPG+NIOCPkCIJT1KQB2/IJN/vk4vPT9McSI/EJT+PagpHj9uLw6/BLnHvtgOfL6Q/kY+QDs1vwCj87zMb7O+5FunvrjjCj5Moi6/GmdJP0Ddpj0geTQ+wI1Ev0DvKT2KRTq/cN+1PZw+dz8wjSW/DC4Dvyzm0L66J20/8klVPxQy3z7UBV0/3rZOv5BoFL6o8B0+wtdRPzAXCr9UblC/VhYeP8AnWT8Y+Bu+yjduv3DQkz7G/ie/BMUYP/jxwz7Ur/c+KKV3v95VI7/EneI+UosoP+hwIj+A0Zu+KJrgvpZFLT8A0Iy+JqNJP1wKWT9sEW2/3HHBPqBriL2Q6+69oJFkvwwmKb+Ah6G+luovv6CL377uLVM/tKBiP8iBEb+Oym8/gHB/PWZgGD+g1Vk9gNqivjCZRT5kml6/ONdovhAeXD/ilCE/tFElv1iEcL8A+He60mcev9Axzb1Edio/gncJv8ipM78yAha/yEq2PupYLb/YmUk+sDObvg5eBL9MADY/xMK8PlogMT/KzEU/gHuqvdLfez/01h+/oLQaPzCmuj2Adic/AJAyuwxWEr+QbWe/EBtEPtSOGD94OH4/NJUEvzBZZj7c46u+pApdv2wwdL/skU0/+EjRvgACaD0YAXo+yDgDvgC+y7v4un6+IMtav1a+YT9Akwg/zMHrvlCx2r0Y45s+yJUJP6yFfT84yAO/HgBLPxBYlj2gLmY9wF3RPrwSib7yLVa/AO7Nu4wXX7+2pBc/Huk2v6B7hD7QqKo+cHMSPmSPGD8gvAe+zvcoP8Y3ZL9YZYE+9JAvv65LOb/QJH++sBzbPiwvWD+g6Ca/IJZ2P8qTIj+Uvgq/CAiUvuCMRz8soEG/gAV3vVAfaL6UJiu/6F4TP0J4ST/mcUE/oBe9vjiGtD7S7WI/wGL6vlxB/j5IHKc+9PVgvxpGc78qFQE/xJb+PproCb+wwGm+7MAHvzSkV78q1Hs/FIfYPjQEMT/w9Fa+jpFtv5CYsL1yPXc/pP2uPtDlcr6yMHA/vBzBPhBHJL/+10q/UkV0vy6NYL/w46Q9Cmo+v6B5hr4MNcE+kL/3PWiRKr4ynXO/CPkMv2BMAj5AyjS+dtllP0jfCD7QIWQ+vFCAvvhCEj9uKDw/2GhhPmAPHb4o4Q0+kgMYvyj0Xb+uoDS/KGZBv/jvR77kqNM+mgtfPzgStD7yR2i/wCFwv8Qs4L4qYAW/0LG7PiYmfL/4Jp0+YI9DvnSBXj+Sf02/AOoZu1YwYj/E/iY/GKUHvly62j6Mj2q/wnBBv2r/Bb8gTE+9irwQPzDMAL6QEAI+EIX9PaSIbz+SVDK/itg+vwIjdr+yggm/CIobv7Dceb4m0BM/yj9svyahA788xvm+oBqGvkDafr1gUS6+thh7P/yvSr80JJ2+pHIAv9bXaj9gtXW9Tp4HPzh4HL5w4vQ9AAEDP6Bp2z4k+eQ+UFjNvTholj7uBkG/qnt1P4CYnj4sii6/cOcev2DBIz18lQ0/TOkRP6z8jb6uGjq/LI9vPwCqKL0UX7i+wNiVvtD74z16Q3E/8IW/PcpiNL9Q8Fc/CLGOvnD4AT5ethe/WLxyv5Dc8b0QPrE9SK5uP7RtxT4AKC++0IDYvrg9b7/cHga/nrJyP0DAd784YxS+iKQFPlj/UT+4Gre+GA1+P+g3F75Uf34/XBTBvpijDD/AJPm80FT1PZbsB792sRG/YPTMPahzrL70lqi+GOElvvDO6z2SOxi/hPhkP5iaIz6c2nK/wKKIvL45Sj+Y2vK+8MAPv5Svfj8cLgW/3hQ6P8LpHD84KPQ+DDIiP3RodT9uxwO/MOyzPgAEiru2Bxy/wLX8PFTV+74gO38+hOxKv+z4AD9wuRi+Lq5wP6gUFj404aK+yIFdP0CYTr6qWBQ/gqZrv5weGL/A4fk8vAWkPoANG75A6VA/KPJIPioZUz+IgZG+mhROP4rXRz+MhJy+EMeVPgqQUD9QLM4+1usqPwyg9r4ASjo9QBQnPYSspL6wZuk+QP0Lv+ppFz8EU40+KC6ovqC7iD5SOj6/DJc5v6aWA79g9P+9wKoDvr7BDL+wnbc9XBwov9A7dL5gnA2/FAg/P+gUw76UARw/4OEJPkTiq752qzm/YONLPUxQ1r6upxk/bK4SP2we0r4Ukz4/ZrITv+ic974A5xQ+3J1+P7jI0b5QlZC+yrMsv8RERr/aZVw/EEgzvuCjLT9ehD6/4KE5voavDz+oH4M+wM+4vWK1Er8QcIO9EAC1PrLBa79ANyC/pPLVvjIkMD84IAi+KpZAvx4rS78Alpi7OB9nPvwG1L6Ay9Y+pA8kP4DB2L5c0Hu/dCfcvoxcnz4WdxY/jvwbv7RRN78qtgy/Lo8HP8QThD6ADWa+MPqnPqgbDr4Ar9S9wL8CP6AAKr8YvSK/VjkHvzARS7/gZXa/cAXFPQhi8r6wy849uPrhPvTwRz/O2Qy/1itMv+5ie7/SV2y/JM8MP1xFAr8OfEa/uDy3vlyNp77gpOg+vmVsv5TcLT+qDzS/YGa/Prh+Jj5oZ1U/Mswqv1D+pL5oaBW+XP8XP8BDNj9ICCi/fAxeP9p/XL/OyhU/kBGCvaIUR78A/oo+lnV1vzZdfj/0Cla/nmY8P5q8PL+mMUK/sNXVPZK0RT/OTTM/UAbMPtjezj5gZO694GW3PogCbr/I7J++Cho0vxLZUj+AOSE+lGNsv8C9sb4Mhta+8F0rv4iHQ78Axq28MIphPja6BT+8VEm/CGQ3P8hSUr+A+iS9HHnjPq4tPr+gzlA/aOtJPsxKcb9YmrO+oCJaPoANrDxIn1G/IOpzv2wuAj/wXA6+4MP5vRLCPr9G32m/6PvoPmQyk760aO0+Ku8SP9BdCr94C1A/UAwivgiXST9iJA2/frdOPzAKTr5W+1a/gE1FvNJ3HD8AQLI7rgclP5qpIb9MhY2+bBYmP5AGUj5wjOq+aNWlPnqdLT+IHwA+wBmSvhzVob6uAz0/QitMPyAt8D7ALuQ84IcLvjjaHL7A1R49tHR8P4zduT5YRfG+FJYiPwCf9T7IdDS+ygEUv3BvIL4SiDi/ACmMvoCfHr28H9I+TFgGP0A4uDxgYpM+MOIfvrL1Kb9M3Fw/QCiivei1pj4AAHi2LGd/vxJCET+wVv2+0E9QvnhZHT4IS5i+CvJdPzj4F76smi6/BoFCv7ITTL/aAzi/0PDGPgglJj9ebXy/kHWqPZDhDD7gOeE+yGo/P87CAD+GzyY/SA5hv0h5x758gqg+cmhDv8zPyz4A8Xk/BFqZvgwIuD7qNRQ/jO7UPvifQz9opzE/QP+lPHC8cb/0gD6/cI6ePQyMGb8o3WA/AtcpP6y/a7+SKHE/rC+svsDOSD8MU+e+EGJXPzic2T6oYWE+QPugPq7HLL+6Al4/PPmAPpJqND9cvlm/6HP5vsjsND/YkZi+bmo9P2BS0z4e/ES/pBWtvl5/b7+wnSu/nIBOv+CL/r5svoA+ALrSPCiGkD4whBa/oDcpv2AqSb46LSe/4JYaPXQbDj+YUSs/aA1tvuDTj75O3Qa/jDOJPiCgYb6ydhW/ILgvvwwpbj/gxDA9plYgP/jMEz7w8c49ljwuP+Dr0b3Aezc9UCX/PnJmKr8A828/4Lv4Pbw5+76gWtc9uI17P4wmRj+YeWa+KO7HPqQROT/s2fa+ynoKvwBGZztQ4UY+mMy+vhhhKT7aKT8/oCpgvbiLrT4AV2O+2KJGPkAOar7EuCw/5hokv0yhmL6++ji/vIMePyieQj+S0VO/QFL3vbRz8b40ZMc+","dtype":"f32","shape":[1,2,3,128]},"op":"window","q":{"b64":"SPShvkQMMb/IWBq+kM2Bvpjf7j70FGo/wOZovzYQcj907k0/dO/VvtQk1b54eQK/gEdMvpiDRD+w95O+AK9DvYpiXj9Ml/y+MEzgvpClvb4Y+hy+mt1aPxJreb8sIHw/EjVWP9hzjz68jVW/EBjJPgDETL74SEO+8Nm0vqDPa75MMl8/+lgFvxi8ND744O++2GmEvtBhxT6q80w/1B0QP7DHv70uDWs/oBGxPQI5cj+q3Hs/CIz/Ph4FIr9OPhu/YP7evmC0Ob58fAY/5BkGv8DRfz0Y03a/mAouPzDc977KiR2/0KZlvujsvL78zXA/gOhlvADWQTvoTyS+hl5Nv+yoir7knrm+XPESv2Cabj/w/Kk+ZEVBvxBezj7ILRS+IPDFPsTCAb8MsE+/cl9zv5qVXD8ImF2/gGdHPH5JI79qmks/2JSqPpAMdL6qfhy/cotAP8CZGT/uyga/Sn5ivwx//75wxGk+wPtXv4h9OT8IwyQ/8nMsPwBbXjzY0hg/fANOv5AN+77KFVS/zMzLvsBKLz8YqM4+2E4IPwDq/b4Mulu/SsJDPxAhQz84lFi/hO2jvr4ZQL/wW5c9YOevPQ5Ier9QLq89+K6uvkRVT7/gFuk++F7HPlB15z4Cklo/rMMAPwD/5T5KtRc/lANNP8C+Q73A3l89+LBlPkT/v75MeBC/TEddP24oHz+QBLu9gLEtPpzaST8QvDq/+hIdPyB0O78UNr4+cLQ3vnyTEj8MxnG/4FteP9DTsT4Yu+q+aFr+vtSQ+b6mAQq/IFeUPsBmM72AS/08xK7cvsCC/Ly4U+G+llY7v6gBWj6mZl0/sD36Pny5Zj/A8Tg+NPEwPwAZ275m+SM/TBdrv2Arcb8mrXU/ePjtvuI4d7/yK3I/4KdaPWgNJz8EVVk/lGDhPqgFhz7ANNm9IFsivuStzT7E3B2/HJtKP3iRFb9EmuI+aGmSvvQNGj8wEx6/8GveviSTFD9Ag0M+4M6HvpI5KL/kPCw/mBZTPwCwBTvWYjc/9FgyvyQ0sj44txA+NjILP9D3+L48W9k+sL09vwhmIb5KvWm/uCN5PgBUaTu0Hoc+qCJQPwgu7b6895o+/JeivmiySr5QOBy+QLuRPm7yJr+QhZU+tpQFP6ZWWL+G8VU/AGsavCR82z7EoJk+QpRSP5DF9r3uWwW/zjcpP+79ZT/wKRO+6A33PkAn3byETbO+gPwDPXJafD+w7d8+DKjSvqh7675Af1u+XuECv1Ctlz2QSNQ9FDOAvv5YQ7+Uu16/aOmlvnBa/D1owsS+hCuaPlDSn74clUW/EKcPv4R0g74Kowe/RoEwP1ImUz/43W+/oITbvio3cz88GE6/5KVIP8bodL80FwS/GGhBvsCCdj1+iTu/QCztPTDbgD0M3sG+1scfv3a3c7/4esG+FppKP6pFM788l+8+dsZeP6hPur6IAzG/pI1zv46JHb/Umts+lKh5P+CpSb4EjJC+INt4vri9hb4AVW68VNMmvyYoQL94+7W+QPtMPsI+W79EX5q++MAPP85KLr/UdvC+6NwFP/BQoD44pyC+Yh5av8Bn/j1wumm/XpIEP2DtMj5qOCC/QLFovgbtOL/Ady0+/COwPhz6fL/gfYI9pC6KvlIidb/wG7s9AKLlvNZeHr9A9N8+jNjMvrR5y77mNh4/oIuJvqCdLD3g0de9iENovrDvKT50URi/nGoOP3CP0z2A7ls9mIb9PjhsQr5AdS2/0IlTv9iDKT4O0Ao/tPvvvry1Bj/o+YI+PHvbPoANKb0ADkY7vJJiP1DZ/r3ICPe+/AEDvwjyJL+41ao+UAv6vTTD+74QPhM+fnEvPyAkUD2kp/u+qPYpPoDV1jzAAG6+YgJRP0oBHL++Rn8/ZB4IP/RdNb92kUc/TC3tvtgSxL7Mtr6+uAv0vtBXPr+M274+INXavlgldj9w5H4/CKQFPm7Mdb8AdFi/ADt3vqw9Vb/A3FK/pF6nPmByzb54gsy+lppHPzRVCL9ieg4/gDUqPwgCDD9AGZ6+msFDP9JndT+EWs0+Ti9xPzwW/T5oUhq/AphevyR1wz56sR0/iLIaPgBOpLwwezi+1vtAvzYGI79sRYQ+CBU/v5zi/b6AeCu9QDAoPwidlb5Uu0w/SvU9PyoTEz8EQAY/hvsyPzw/pz5MJnK/SFdxvhCzij1Yv3I/HLmzvngxTz7WlCU/fpZDv/hVx75WZXO/hnEzP9KIHz8AuoC+2C2fvgaVaT+I6Xg/PMW1vsBXvTzMvqU+9JFBP9CgFr6oCvS+CG8Gv4ATHr9UF5g+7JtsP8jtWz7oGJ++6uUQvwB9fD/cMfu+PCVAvyZcRD/kSSq/AIjuO4AE2zyAhF89pgxTv5YOYL90DCi/OPgmvmJIO79+O1M/0GlwPvAWCD8c5BU/fGn5PkorWj/wdwu/1l1aP/Jga792KDc/4u1vP4CW57w4+Jy+sio9P8iGMz7acio/DK40v5KgMD9IAb8+hJ/EPgBENj0wJry9Nss0v6Bzpz22tx6/5FfWPqJGUT/A8hu/TrlDvyD5Kz3uiQU/NDLhPtCLIr+oXLe++lYjPzYxTD+I3i2+wjR2P05cWT+s/Qw/pgp1P97fMj+KGnI/UKs9v/DfXj727zE/Jq1WvwCl3jvoyQG/qKQePxDzOT4QEeA+sLxsv2Q5GL+A+ky/QNnwvWC9cr9cems/CIdCPuhjWr7oj6O+uC4GPqStM7+o4IO+RDNZv2CCUT98jnw/JPq4vh7TM7+Q7ri+qIubPtpHOb/UtXq/wFipvpzfZT/Gzja/2AdyvrimqD5mWFc/yJ7ovlA+070gkBY/XkojP4isyL6yJmU/eLyGPvYOLb98vl0/7Ml+P9pHcz/qeyU/eNHMvlwNVj/gZc+9uABNv4B8y72oiCA/vLPNPgBuNr7Ib3Y/2pUyv35qBz+U/MY+Zj4Zv/AUKL8gGHM+DuJHP4TXgD7oXO++OtZ8P9j80j6GUCG/+AfCvgApjr2MJh8/xOhUv5Krfr/cF7q+jO1TP9yWFT8AFsQ77D5DvzRX7z6ABGM/2PQZPtpCNr9S3GW/fnRhv3RI4T7SMGG/3qhav+BXD78AVng+OPtnvwArDD9OTFq/yClrv8TnCT9ydBk/8AIoPqCa+T00tMi+HDZfP+StmL7smp4+EHsRv3ipPb6wLh0+0JTQPXDFkj7gS3Y/UsVKP4jtGT8MIW+/uOY6v1DHlb6A6t68aFTEPmB2Ir7AUXC9ri1KP9Dv9r3klK++wBAgvwDc2D0aGki/FgtWv17hID+YcwQ/qOPBvoAfkb6AqNO+UjETvxDhEz6iJi6/iIJJvsBvGr1g5hM9DBrDvoTnr74m4nu/tOALP1i0o77U+Yi+wL2MPGiKAz+AvDK+hF+evkCHbj/wt1E+Xg1Hv2LMPD+QysW9yOlFvkRa5T5KNA+/ADB+vzzx3j4iTAW/OAbUvuS+xL5wxEw+7KPevnQ9Mj+gd1c+ZPsWPxRo8r404es+QOyOveSlxr44QoS++KvrvkQObT882ry+NlV8P8QSvT7AuLq9/AjZPkBWGb0i6Ta/zGUZP+w+tz7owUA+/jUBv8YuQT/89hk/YDgBvQQc5D5wjdm+ALzFPsCSZL28r20/DDU4v6oac7+A7nG8OGWnvvAEwr44whE+SEjYvigisL5iZUC/MH86v1yjrT4YG5++0ETGvubsKj9o1ne/oLsjvWzX/L727i8/YINGPcJ9Oz9MKW2/8GbMvZCEsL1AyLu+FtoGv0QqgL7MvV0/yAivvgbZcz+gcPK9qApbvpRHqz78qxe//FZ6v97dCT/G4yi/YESMPbwfmD5oZma+8BFlv37mF78cGSg/0M7OvpD6Gb4qlxS/AGckPNjCCr6Yeky+pqw0P3ifaj+I63M/KpVnvxBT170i4Dy/al0evxhfwb4YXoC+/OQBvzDRd786Pyy/SNR8v4ZsXD9g4P0+Dpp5v+AeG78Qr/e+ro56P9DeF7+A8lK9xJa3PoDBB76sM5S+wHQ6P5jWVT+Qsdq9OHAsPri/sL7gD1I/YtIAv3TIQr9yVwG/FkNxP2IbHr/0e3S/LOBiP7j4pD6YngG/RPJ7P2o3d79w4x2+qAgaviCD2T56Wxs/qDYWPpB4OL8CnQM/mmdkv6BVIb+eyi+/yuxkv6ZlV7/cIto+QOQ8P4AuBT1+6VU/GhZ6v3xbkT5qHzY/1vcWPzAqyj6E6CQ/HOzQPnyMC78oBcu+apISP8A1OD9iPHA/Yt4PP7z3iL4iHyw/APATP4AbK7/oaHo/kAOZvoYjJj+wU8K+VqQcP+YSbb+w3Hq/Bu5lP8D7yDzAQ0O+8rsLv/jUQj6gaui9gtZJv8zD6z5s/Bu/4M3cPfg/ib4MJW6/6HMiP+y1qL7kCp8+4E9DPxBrLr5YTSW/eLehvgzV5b4w236+COLQvvi3uL52ZAC/kkwtP1oYfr9G2U0/aOBGPpDh977E5iq/+jRWv+gqE76ujyM/YHvwPi4Oeb8QDga/bIadvoICSD/IPDO+yJQiPlAbxT6AcxG/eFISvlwJDj+4zu2+ckosvwD5Dr30GXm/GA5Cv6D2pT7YRfc+qHr5PrB+bj+w/RW/AGHGu/y0pj5IId0+gLgqvNAcRz6k+L++VCwBP6xu0j7QFty+hMBIvzx1+T6yN0+/Yv4EP2olRz/iEEg/qFVQv1iXKT9g2Rc90AulPtoMUz/0onK/Sid4v/CFNT/qq3A/ADrUuwBM17pYFbc+SDBpPqxIpb5OzQG/fmgivyxedr98cUQ/enkLP9zAUr/Ayz29QBq7PhyTib50jSI/HPqHPgD8KDxAjPA+8gR0PwjS97525G6/qC7zviwLET/UuG8/9vgnv/QrfT/ewSe/QpkLPyqWYD/QJjI/sJDlvSA0ob6iU1A/8BWHvjgmxz54/xa/8Bk8PvSHQL9scUS/ygVqPwDwdr7Aqtm9jqRWvwhBID4Asmg8vOIhPzi/Mr5coWE/OPR5vgiITL5AV7G+hlNZP4JuWz9YCby+7JTkPmQw676kc58+Kv4Yv6BSm77AxnI/cJWIPmDA3b5gRpM9msM6vzjgOb52g02/ZJc8v3TeOT/oYKa+5Fm3PkBE2zzo9UA+YLxCPwyxBT8kMoE+xMoGP9T4Kz++hk2/vFLHPiD0Sz/wSDE+yP12P8ZdYz9sMNq+MLMwPta9f78QAGc+JIPEPlC/7b4a2n6/hiZIvy7bCD+Emp4+mFYkPpBmW7+gDNK9hOwTP+hu6b7E9/a+QP6TvMhs3r5oIhU+lrkyv7g46r5CYwQ/4F0LPabTGL+Yy1s+8EF8vkLLbz/waTG+7s9rvzJfWj8aUCu/EPW5vbSlIb8elAk/YBs3PxD+1D3isjW/NKbYPnhUOb5E0xq/WNZ8vsogFj/w+xq+4DCNPgxTM7+4+7Y+4EcfPYDEfT8ABAy8fA+Kvir4IL+8YIA+DIXYviQ6+D5sxbA+sIHuvvyqKj8oqSG/mjoMv4DjGj+MzvS+wFtZPQ7QDb/oaj0/3Dkjv2wgyb7ABQQ+WqImv6JRZr/w+hq+DPa4PhgAHz7GvG2/CLiAvvjnaz80C2Q/AN92PAogSr9wO9q+IA29vnBhdj62kG2/4owSv0yO4r6kbMU+uD5kP5ZsaD/AAxS/OPK5viQQPr/gMjI/vvcmPzxgJj/wtxe/VH+Mvrqva7+4V1k+GoUePzAXnb3IrUe/IHrCvYxWhT60maQ+kDlvvywqcr+osBW+9mVXP1ByDL/QVyQ/CMCVvngYIj+oP4G+ADAkviYvXr9Q2ZS9QN0kPcAwsjyy71e/cqB5P6bLLT/wqci9TFVhPwjQXz5CQR2/dNmHvgB97bsIJDQ+6DymvlRNiD5AazU9ULHSPlAyaD+89l0/nrYkv+ZwYD+upjY/ELXmPeSdeD8wNbG9dttqv8ycXz/k4pS+PudJPyyLpj7qbxi/uGbMvjQT4L4IwgQ+XBsbP/Awrb6wZDc+ks8Iv3ZWHT+c2fo+IBLPvvAl/L1Czha/2K9rv4inID+8G2c/+uopv0IoaL+ADJu95jIlv6D+gz18GPY+COiaPgoPKL82IFQ/HipFv4QU9T5KjmQ/wDvwvn4mL7+UKHS/1Gy0vkTIk76Awha/fCr2PkrjfD+g+lu+dqwSP6JCZb8UuC2/4sxEv7JHGT8Asmk91JaTPub7Jj94gj0+fBCIPtbVYT9oxpc+ildcP6CoyD2sgLg+iHKNvoBoa7/OK38/wN/CvNxEWz+KHTU/NlpKvwThk75A9j49AHzZuiB9Mj/g+ww95og4v4ptdb+AO2s+OM6KPlAZwD2ch2U/0OiBPtCFID9olUQ+TJaRvjBE871IFFK+0E3oPvS5ob6OXXG/lhgkP9QLpb6QX+M+XHU1P7wjv76YcwS+QE/avMBInL5wrby+BttLvziuoL7s5x2/4KIQvsCdwz5Mu8I+1FgSP1L/AL9QT9W9MP/kvvjyKj8U6as+zOgcP0wPib50OSq/gBm3PQqrRD/g3Ks++hEZPwQfVD+giVi9YHVTPj5BYL9wnKm9ag5Qv07sR7/I2mG++FvHPihyc77AA6E9PN5Gv/qGOj+00ES/QIzmvGBVXz8+cCi/lGd8v2bzDr8A6Lc8NIA6v97uUj8Qqyc/jKwBv3S5vD7Q2YU+YOQrP2CbIj8wKpO9CLO9PthkC744kzm+QucWv7xJrj4YM8m+5oYjv4C+ir4Qg2c+LIVVP+i0Dz843IA+KBCmvthcFT/8a9a+QGpoPRTCNL/2F2S/FghSP+7pXr+QX4W+xMS4vlhtKr+o6yU+gAFwP3LfVz9wQ7A9dLSXvmiPHT9g1jG/mD8eP0pMLj8+dFa/COGBPthOAz7WFmI/YkNUP8DDIT8gYCu9Qm8NP/65Yz8kicc+ciwtvwCNtbvMpQi/CLRqPhDR7D1Sinc/yEdZPhBgM75q0Cm/wAFzP+Qger9Qu1w/Lqhov5rKKT+W2Xs/9F5fv4DGsD6YtCo/dGqWPsAGfj76qga/8mN8P4TWXb8gc4g+2KY4PhDAvj7sE9U+XrAfvyTuer/0RWo/TFSBvszO975cNoc+thcFP1h8XL92iHG/TBqZPp4dO79wv2U+0O02vvhQv75Yu42+ZDiwvoR0Wb+CiRo/zFddv3J+cL9g0sC+TKlPP+rsIT+ULo6+dNN7v351Yb98S62+GE59P6BDOD/sRZy+MIYhv5iFn76QP3s/KDnGvn75Dz8gjD09sM+3vcRWXb8cpQg/PPm8Ppjytb6Ogkw/2HAhPuT7ur7SBic/WKSIvuhqbD+IOCG+wNNpvlZAWL/U9Z6++q8tPxiOwr7IZKq+JK2LPtAWfT+K3zw/tNwBP2r2DT9gKp296P2DPpa9Pb/wK/69cL6xPn5jPj/UvII+xASPPpCN7b6O8Ec/AD35PUQqA798ar2+oLopv+hg4r5kEye/WmBCPwAQ4L0Q7AO/qJbHvmR/GD+sbLC+Dv4pP8J8ab+aD2W/vIsyPyh0tj7S2Hm/cMu2PTgdeL40zkS/8OodPvDlij2Qab8+5CyAvjS1hL4um2g/4P3QPuT2iz5qZG+/JoM/v3jkUD82exE/OslNP0SBmj6Qfaw+zAHdvkDiDT66YkS/srERv3LbND9QMcs+YB5CvSwFpj4Agh07usFLPzB3GT5ojoQ+VpVEv+zMVr+Wqha/rn82v8gCrr6qtFW/IJbCvmjNiD5ClV2/QGscvVoWbT9ws26/6HxMPyihA7/osKM+Qp5BP6AgOj4iIFU/PkooP/ybKr9gEUM/MjkVvxitQb68y9q+1HZMPyAG1z5MtzG/oJwVvtaDfL9YjGA+pP+qPmKkKj9iRgQ/hANOvwCZ/bwCGzW/qEcaPqh5br7+ojC/+CFsvwCQLbpQYDk+ggcfvyClK7/UrcU+4oowv3Z9aj9mLWw/yHKLPtyd/j7Is0++8k1cv2A98z7s4+c+kLFEvkDH9LyQg9W+AJOSPEBS8z5y3Uy/2ME5P4DmI740AMg+ID2jvZ4XEz9QPOu9iDAovqRjFj+woTu/lkI2v4oxPL8AREm8snN/v1xi9L7ikVy/Dih4P24KRb8Ymwm/eO0EPg5+bj/ScyS/YOB8vWykhT6gXZ09stQpP3QIYr/g0Qs+dLYbPzpBaT/KwBk/qMQOviq8A7+Q0Qu/YDMfP/QpeT+gozk/st9kv3Rkdz/AUKG+","dtype":"f32","shape":[1,4,3,128]},"scale":0.0883883461356163,"v":{"b64":"+rhKv6Dytj6YO0g+ZAmXPkC3F72UxoQ+fqAkv4YpKL+ofli/nrZkv7zSsr7cbdA+AJwmvuA2Mb9q032/JJ+qPmjPYb7uV1o/VJZdv8Cl877YMju/IMZBv7zE4D4cEH2//PZgP/hh6z5+018/wLTqvRZRIj8Y3OS+xP3evtz+4T6A7l++hr12vx70Rj8MEJm+sDjIvgiVfD6asCm/uGQdPkhZgr4oea++HtMCP1ibJT+wCho//AZtv8AlxT3gJwI/tC4yP9Ti0z6AFa49WCXJPqzsXj/gVYw+EBp9P9wqcL8888m+TglEv9opX7/4mdI+oNELP9jBIL6CvWM/HL91P+B0PD6oYcq+4Aj3PuASYr9ydFW/ujl/P47SWb9Mi4Y+PGINP9w59j5IIum+kgYrv+j7wT60MuA+oP7fPTwV9z5oxDS/sDdEv5bcKz9AseI+Dn9lPxjpb7/opWq+hBlQvzg+G7+sbmI/yNJUvnjJsr4UhEC/2JK3vjDoAD6EBzU/sNzPPZB4Xr4wB0o+dKo4P3haQ7/A75w8UH2KvZz2pb4iLz4/oMWfvYraJr9k3nS/NJx2vzDEu73aaA+/mIAoPjDtkz0IQfI+MPLpPoCbWD1gWZm+qpE5P4CaNz4c/G4/bK+GPqANMb1QCJ++tCqEvnAuyr3QK+Y+1PRIP1CJ9j12/0a/pJNmP5ipMb4i+36/pt1pP/jnp75cGbQ+TMrvPnhkr768RdQ+2KGmPtghbL/QEhY/aNbRPvgPRz+Kkle/GPoAP9jjJz4Qawe+Xn1Zv2CLbT8IFzO+ONwiP4T/3z6wDps+2BT9vpY3A7+weBe/grYUv7Af/z5aVgc/HHZQPwC43ruA/iy8dEWXvkZvHb9o3g0/KC/LvsAx+L6AZw0/wB30PEA0hj58aOo+3OUZP2D/J77Ob3m/IDBgPxbxHD+KFz2/Vnt8v6j4yj6onHw/zHhov0amOT+YH8C+WkVIPyR1oL5QldW+CNwoP5YVDz8Y+Js+4Ih6vcoYOz+2Ck4/5LfxvrDyFL5MnU+/cB2wvlDkcz7iDQc/vFHaPtJJbL8smSC/6lsvP0zz8r74aeC+tAg0v6g6Dr60z/2+NHMqvxqFZz8wjRq/gG8uPjTBJD94w6w+4Ht6vqg3kj7QjmW/4E33vnDPWD6oQFS+6HJdPpoAOD/0aJu+1E6NvnyufL9iKl2/aANmvoQ3SL+4xOm+MNcIvsAnFL+KWTG/vIsGPwCo6D4W400/1F1JP5IOCD+axhG/4J5QPnQIu774wTq+DPCSvijeCb9AgGe9tIfUvniRzr56kxI/piRxv4BPSTyKex8/lOilPsodOz94Gjc+fKzmvnAM1D68Vl0/rll3P/z4Gb+qgxI/XPvPPtzmrr6y70C/nAQuv7YuQr9sNGS/Cp8Zv8BWn7wg0Eu/zHq/PkCcIj7M+rK+MLBMvjY5QL9Yb0w+aMrYvkgLTr+O63W/YNSoPWIhRT/AODK/hKAhv0TlXz+2EQ4/sGh6vrCwuL5ACcQ94G1gv4KQWr8AMyy9cOv1PuBcyL04HCW/Znh/P3jb9b6e1Ra/tGa1PgCsf7tmfTo/EAHuvkIDZb/MT/Q+QBauvNpDIr+yAE6/tsV5v5Axv75OH04/9hlLv3xm7T7yO1s/AOkFvIDkJz8u0yu/irk9v1KfSb/ctns/MmJpvxi9CL+Ilro+5kMfP74zeT9QgEg+vFJAvySKiT7AIiA9emhCP4jM6T6UtR8/sAPPPqrTQj9Ae1I/2ADAPhjLHz/gVS6+gp1dP5JWcj/GA3g/yJf9vsbNa79G4G2/EM1Wv1DBbj7gVAa+GKctvyKfDD84WJE+WMQDvpgMPL/OQkg/UvFCP3Tzi744402++HfYPvg95r7m9jI/EGZmv1AuMb4kT2y/wDnOPUgGWj9ojhG+3GcnvzbjF7/Edyq/WE5IvyijwT7GP1o/HKj/vgg0Wb58VAc/BL+dPn6JJz+Aq2u8JHZLv0BJpD0exnu/7I/sPnp5Fr8Inno+uHFLPh5Uer+2Ry8/DGLFPnQdXz8y5V6/VN98vyCVtj5kQmK/+vIkv2RNZL9gu2Y+2O7XPtwg2j7KzC0/gkJ1P4hsZL5QuWG+UOwzvm6ncj8Ozy2/UHfdvaw/zT66ASC/LKz5PtCJmz64fTc+yOPQvkCeRL/wRfu+oJA1P8ywWz8I6Ui+oGIuvjjsTz/wd6C9iGEIPiCeXD16ahK/luYgP8QpHr+0dvS+BiMXP9QKjz50K9I+JhwOPxxEnj6UteS+SENQvghoaT7qyHc/SNIvPoQcyD4sny0/+CEpPwg7YL6omkG/2B12P3A15T60xKW++BE1vlgUt760Td2+jAcDP7TTVL8Qp6s9/NGfPqRzVj84D8+++nFHv+ByMb+sP+M+MHz7vrC7nz1QJ/++8Eh4v7h8rj5sJQW/Bidsv9zdwr5uCGo/AG5avkgfkL7geOw9AL0lPkoIHT/QQVm/VJLHPtaVCz+4NRc+/G+JPlKXfL8sGN6+GLGHPqJnHj8i/H+/8GjMvYj4L78oHYE+LLw5v7iocb+QYWy/4F27PngB/b7AoNU99iJUP8ge0r5o5AE+OAxmP1CtFz64BgG+qOkRPijruj6IJgA+drgeP/QLkr72lyS/YAvXvSbwdr8MNBg/4C4lvUCvAL0KWws/AG6TvtRAXb8e/H2/5D+/vsBHNr/A+Au/4LPqPkD2RL0SVWi/yGIXvlIEbz9UXXA/WqUuP9SLyL4+zBa/IM5sPQhOxr7AfSY+JG0rPxR7nL5AFGQ9Yhsuv1JqNz+ARlQ9ZGjLPoQtSz/YzBk/LF1+PyKsTr8ASHm/DNpEPz4/TT8gPEw+7CP4Pug7D74OGCe/oBbmvrBba74UpgS/KMzyPhSAnr6Mhhw/qAQLvgB22r5EbNo+uGluvxDYtj1gGGu+uJ0jv247FT98pyS/0CDGPZ4MV7/eFxU/fqUkv/Amf7/U1Cm/9Jtxv6CjYD/EFq4+OLp0PjpKe7/05Pw+6sUCv0zF3j7EmbA+dlY+vwAfgLtAVdA9AGqkvMTLE79yaD0/+hIbv4Bd9r1o9g0+3McpP5g5Az5oHaM+/KmePnQKPb/sGxA/SAFtP/jLMT6MBeg+NINpP/BrWz4sbAQ/xiMrv0D0lL0QEJe9BgAkv4BYFj7owyQ/mA1ovyzfz74KlXq/AMJ7v/YpWz/Iii2/NDgaP+bZYr+g6w8/ojEIv1RSCL+gexK9ZrNWP+jzVT8gMXy/gh8gP747FT+gI7C+MKK/Pub2fb841xQ/SPk5PjYSJr9gE/A+gEJSPUBksD4QGZG9NKM6v/QcIj9mE0A/tDffPn6BEb9ktky/9KVKvwCWsz5oCGq+MHQePowEuL7QPgY+UL1cvi5CP78MAEK/ykMIP5p8LT9ycB4/MK8BPpKCar+4qwq/LFwrvwThzb70Dnc/qpsyP2g7Lb8sLYO+TFBbP/D3Aj5sams/YClVvjAbNb4wwUq/gFDBvCApU75YP6g+RvonP1BQjj0QA+A+Ppwqv8SvKj+Ix2q+0C3TvqpNEb/40ks+GFKqvuCFUj1A82S+juoKv4awQr+KLQ+/on9jP9QW4j6W8wk/GOYzP4iOVD+I70Q/BlkeP5xjND9kHPe+FFOfvsBImjyW6Ck/gFBHPAYkGz+8j2E/4FJ6PkSHgD4QGqY+oAgRP4iPzz7YG8W+3D00v2hD2b5oiO4+EMwbPsQv7T7UDm6/VKzcPgzz0b6wtxE+mCExPrKuNT8AZHc9YFsxPrBqrj2sS/y+1mVwP7otJb8ypxW/yOt/vwAEFz12Qz0/XJ29PogpC77853c/oPpQvXgsNz7WsB2/Dq0EP2qWUz8Acn2+YCWqPtQQwD5UHpo+fBQMP/hrgr7IjEi+YPAnvhSnqz5QENw9qBJ1PwarVL9sXn+/UPUWP5rEXr86D0A/UKHcPeyyR7+2Ule/oJ0zv5DV1j6gxgU+crY/v7Anhj0WgTW/GB1SP8LBJD+AMP0+oH0rPizPpz5aShQ/mP7LPriVKj4Qctc9rmZRP7ohYb/4WzU+SBiqPvw+tz6gKA+9xkZVP9r/Ij+oiC+/WAVDP1JBWL+EgNg+","dtype":"f32","shape":[1,2,3,128]}}]')
DIVERGENCE = 'adapter_error'
OPTIONS = {}
repro_main(MlxOptiq(**OPTIONS), CALLS, DIVERGENCE)
