# An engine that misbehaves in the way its first argument names (`ok`: answers `state` with an empty cache and
# refuses every other request), for the tests of `kvsim check-engine` (`byoc/engine/tests.rs`, `tests/it/survival.rs`).
# Python with no MLX; its second argument is where it writes its pid. The `binary*` modes take kvsim's offer of
# binary frames in `hello` and answer `state` as a frame: `binary` a good one, `binary_span` an array outside the
# frame's bytes, `binary_count` a byte count that is not one, `binary_cut` fewer bytes than it announced.
import base64, json, os, sys, time
mode, pidfile = sys.argv[1], sys.argv[2]
open(pidfile, "w").write(str(os.getpid()))
def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
def send_frame(head, blob):
    sys.stdout.flush()
    sys.stdout.buffer.write(head.encode() + b"\n" + blob)
    sys.stdout.buffer.flush()
for line in sys.stdin:
    req = json.loads(line)
    op = req["op"]
    if op == "hello" and mode.startswith("binary"):
        supports = {"binary": True} if req.get("binary") is True else {}
        send({"ok": True, "protocol": 2, "engine": "fake", "version": "0", "supports": supports})
    elif op == "hello":
        send({"ok": True, "protocol": 99 if mode == "version" else 1, "engine": "fake", "version": "0", "supports": {}})
    elif op == "new" and mode == "exited":
        sys.exit(7)
    elif op == "new":
        g = req["geometry"]
        send({"ok": True})
    elif op == "reset":
        send({"ok": True})
    elif op == "offset":
        send({"ok": True, "offset": 0})
    elif op == "state":
        # every run's first state check: an empty cache's K and V, or the mode's misbehaviour
        heads = g["heads_kv"] + (1 if mode == "wrong_shape" else 0)
        empty = {"dtype": g["dtype"], "shape": [1, heads, 0, g["head_dim"]], "b64": ""}
        if mode == "malformed":
            sys.stdout.write("this is not JSON\n"); sys.stdout.flush()
        elif mode == "truncated":
            sys.stdout.write('{"ok": true, "k": '); sys.stdout.flush(); sys.exit(0)
        elif mode == "timeout":
            time.sleep(60)
        elif mode.startswith("binary"):
            span = (2, 4) if mode == "binary_span" else (0, 0)
            a = {"dtype": g["dtype"], "shape": [1, heads, 0, g["head_dim"]], "off": span[0], "len": span[1]}
            body = json.dumps({"ok": True, "k": a, "v": a})[1:]
            if mode == "binary_count":
                send_frame('{"blob":-4,' + body, b"")
            elif mode == "binary_cut":
                send_frame('{"blob":9,' + body, b"abc")
                sys.exit(0)
            else:
                send_frame('{"blob":4,' + body, b"\0" * 4)
        elif mode == "refused":
            send({"ok": False, "error": "ValueError: this cache refuses to show its state"})
        else:
            send({"ok": True, "k": empty, "v": empty})
    else:
        send({"ok": False, "error": "NotImplementedError: " + op})
