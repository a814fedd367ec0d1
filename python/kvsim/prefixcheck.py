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
