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
