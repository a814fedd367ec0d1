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
