// Draws the selected op's pictures from the page's data (the element `kvsim-data`, in the compact form
// `html::compact_family` documents) and marks the failing cell.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("kvsim-data").textContent);
  var SHOWN = 96; // columns drawn at each end of a very long window
  var KINDS = { t: "tok", p: "pad", z: "zero", u: "unknown" };

  function el(tag, cls, txt) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (txt !== undefined) e.textContent = txt;
    return e;
  }
  // Hues 75..305 only: red stays the colour of a failure.
  function hue(req) { return "hsl(" + (75 + (req * 67) % 230) + ",70%,78%)"; }

  // One column of a window: [kind, req, pos, n, flags] run `run`, its k-th column.
  function cell(run, k, i, rowReq) {
    var kind = KINDS[run[0]], req = run[1], pos = run[2] + (run[0] === "t" ? k : 0);
    var odd = (run[4] & 1) !== 0, named = (run[4] & 2) !== 0;
    var cls = kind + (odd ? " unexpected" : "") + (named ? " named" : "");
    var s;
    if (kind === "tok") {
      s = el("span", cls, (req === rowReq ? "" : "r" + req + ":") + pos);
      s.style.background = hue(req);
      s.title = "temporal column " + i + ": request " + req + ", position " + pos;
    } else {
      s = el("span", cls, kind === "pad" ? "pad" : kind === "zero" ? "0" : "?");
      s.title = "temporal column " + i + ": " + (kind === "pad" ? "padding poison" : kind === "zero" ? "zeros" : "bytes of no admitted request's token");
    }
    if (odd) s.title += " (out of the row's own order)";
    if (named) s.title += " — the column the failing check names";
    return s;
  }

  // `head`: the physical column of the write head (drawn with a blue edge; past the last column, a trailing mark).
  function tokenCells(runs, rowReq, head) {
    var box = el("div", "tokens");
    var cols = [];
    runs.forEach(function (run) { for (var k = 0; k < run[3]; k++) cols.push([run, k]); });
    function add(i) {
      var c = cell(cols[i][0], cols[i][1], i, rowReq);
      if (head !== undefined) {
        c.title = c.title.replace("temporal column", "physical column");
        if (i === head) { c.classList.add("head"); c.title += " (write head)"; }
      }
      box.appendChild(c);
    }
    if (cols.length > 2 * SHOWN) {
      for (var i = 0; i < SHOWN; i++) add(i);
      box.appendChild(el("span", "gap", "… " + (cols.length - 2 * SHOWN) + " more …"));
      for (var j = cols.length - SHOWN; j < cols.length; j++) add(j);
    } else {
      for (var c = 0; c < cols.length; c++) add(c);
    }
    if (head !== undefined && head >= cols.length) {
      var end = el("span", "gap head", "›");
      end.title = "write head: past the last live column";
      box.appendChild(end);
    } else if (cols.length === 0) box.appendChild(el("span", "gap", "(empty)"));
    return box;
  }

  // A ring's physical columns, numbers and the model's ring where it differs.
  // `live`: the layer's live window runs (the physical runs are `0` when they are the same); `offset`: the row's.
  function ringLines(g, live, rowReq, prefix, offset) {
    var out = [];
    var line = el("div", "layer physical");
    line.id = prefix + "-phys";
    line.appendChild(el("span", "lbl", "physical"));
    var runs = g[0] === 0 ? live : g[0], len = 0;
    runs.forEach(function (r) { len += r[3]; });
    line.appendChild(tokenCells(runs, rowReq, g[1]));
    if (g[6] !== null) offset = g[6];
    var txt = "offset " + offset + " · len " + len + " · head " + g[1] + (g[1] < len ? " · rotated" : " · in temporal order") +
      (g[2] === null ? "" : " · last window write " + g[2]) +
      (g[3] === null ? "" : " · left padding " + g[3]) + (g[4] === null ? "" : " · " + g[4] + " prefill positions pending");
    line.appendChild(el("span", "note", txt));
    out.push(line);
    var m = g[5];
    if (m === null) {
      out.push(el("div", "note model-agrees", "model: the same columns, head, offset and padding"));
    } else {
      var ml = el("div", "layer model");
      ml.id = prefix + "-model";
      ml.appendChild(el("span", "lbl", "model"));
      var box = el("div", "tokens");
      m[0].forEach(function (t, c) {
        var s = el("span", "tok" + (c === m[2] ? " head" : ""), (t[0] === rowReq ? "" : "r" + t[0] + ":") + t[1]);
        s.style.background = hue(t[0]);
        s.title = "model, physical column " + c + ": request " + t[0] + ", position " + t[1];
        box.appendChild(s);
      });
      if (m[2] >= m[0].length) box.appendChild(el("span", "gap head", "›"));
      ml.appendChild(box);
      ml.appendChild(el("span", "note", "offset " + m[1] + " · len " + m[0].length + " · head " + m[2] +
        (m[3] === null ? "" : " · last window write " + m[3]) + (m[4] === null ? "" : " · left padding " + m[4]) +
        (m[5] === null ? "" : " · " + m[5] + " pending")));
      out.push(ml);
    }
    return out;
  }

  // A read's mask: its kind, and a matrix as a grid of visible (blue) and hidden key columns.
  function maskBox(m) {
    var d = el("div", "maskpic");
    var kinds = { none: "no mask: every column visible", causal: "MLX's bottom-right causal mask" };
    if (m[1] !== "matrix") {
      d.appendChild(el("p", "note", "mask of " + m[0] + ": " + kinds[m[1]]));
      return d;
    }
    d.appendChild(el("p", "note", "mask of " + m[0] + ": " + m[2] + " x " + m[3] + " queries x " + m[4] + " key columns" + (m[6] ? " (clipped)" : "")));
    var t = el("table", "mask");
    m[5].forEach(function (g, i) {
      var tr = el("tr");
      tr.appendChild(el("th", "note", "row " + Math.floor(i / Math.max(1, m[3])) + " q" + (i % Math.max(1, m[3]))));
      for (var c = 0; c < g.length; c++) tr.appendChild(el("td", g[c] === "#" ? "on" : "off", g[c] === "#" ? "" : "·"));
      t.appendChild(tr);
    });
    d.appendChild(t);
    return d;
  }

  // The k-th recurrent layer of request `req` as the latest op before `i` saw it (for "changed").
  function previousSsm(fam, i, req, k) {
    for (var o = i - 1; o >= 0; o--) {
      var snap = fam.ops[o];
      if (!snap) continue;
      for (var s = snap.s.length - 1; s >= 0; s--) {
        var rows = snap.s[s][3];
        for (var r = 0; r < rows.length; r++) {
          if (rows[r][0] === req && k < rows[r][2].length) return fam.layers[rows[r][2][k]];
        }
      }
    }
    return null;
  }

  function layerLine(fam, i, rowReq, li, k, prefix, offset) {
    var v = fam.layers[li];
    var id = k < fam.layer_ids.length ? fam.layer_ids[k] : k;
    var line = el("div", "layer");
    line.id = prefix + "-l" + id;
    line.appendChild(el("span", "lbl", "layer " + id));
    if (v[0] === "ssm") {
      var p = previousSsm(fam, i, rowReq, k);
      var cc = !p || p[3] !== v[3], rc = !p || p[4] !== v[4];
      line.appendChild(el("span", "", "conv state " + v[1] + " #" + v[3] + (cc ? " (changed)" : " (unchanged)") +
        " · recurrent state " + v[2] + " #" + v[4] + (rc ? " (changed)" : " (unchanged)")));
      return [line];
    }
    line.appendChild(tokenCells(v[2], rowReq));
    var w = fam.window === null ? "linear" : "window " + fam.window;
    line.appendChild(el("span", "note", "live window " + v[0] + " (" + w + ") · " + fam.storages[v[1]]));
    var out = [line];
    var planes = fam.plane_sets[v[3]];
    if (planes.length) out.push(el("p", "note", "planes: " + planes.join(" · ")));
    if (v[4]) ringLines(v[4], v[2], rowReq, line.id, offset).forEach(function (e) { out.push(e); });
    return out;
  }

  function familyPanel(fam, i) {
    var snap = fam.ops[i];
    var d = el("div", "family");
    d.id = "family-" + fam.name;
    d.appendChild(el("h3", "", "family " + fam.name + " — " + fam.geometry));
    if (!snap) {
      d.appendChild(el("p", "missing", "Nothing observed at this op (skipped, or not reached)."));
      return d;
    }
    snap.s.forEach(function (st, k) {
      var sd = el("div", "stage");
      sd.id = "stage-" + fam.name + "-" + k;
      var batch = st[2];
      sd.appendChild(el("h4", "", "State " + fam.sources[st[0]] + " · batch rows (request per row): [" + batch.join(", ") + "]"));
      var calls = el("ol", "calls");
      st[1].forEach(function (c) { calls.appendChild(el("li", "", c)); });
      if (st[1].length === 0) calls.appendChild(el("li", "", "(no production call)"));
      sd.appendChild(calls);
      (st[4] || []).forEach(function (m) { sd.appendChild(maskBox(fam.masks[m])); });
      st[3].forEach(function (row) {
        var req = row[0], b = batch.indexOf(req);
        var r = el("div", "row");
        r.id = "row-" + fam.name + "-" + k + "-" + req;
        r.appendChild(el("h4", "", "request " + req + " · " + (row.length > 3 ? row[3] : b >= 0 ? "batch row " + b : "solo") + " · offset " + row[1]));
        row[2].forEach(function (li, n) {
          layerLine(fam, i, req, li, n, "ring-" + fam.name + "-" + k + "-r" + req, row[1]).forEach(function (e) { r.appendChild(e); });
        });
        sd.appendChild(r);
      });
      d.appendChild(sd);
    });
    if (snap.m) d.appendChild(el("p", "missing", snap.m));
    if (fam.kind === "kv") {
      d.appendChild(el("p", "note", "Live window: temporal order, oldest first; physical: the buffer's live columns in " +
        "physical order, the write head with a blue edge; tokens identified from the K bytes (self-identifying values); " +
        "a red outline: out of the row's own order, or not the model's token there; a black frame: the column the failing check names."));
    } else {
      d.appendChild(el("p", "note", "Recurrent rows: offset = positions fed; the round and the spans are in the calls above."));
    }
    return d;
  }

  function select(i) {
    if (isNaN(i) || i < 0 || i >= data.ops.length) return;
    var prev = document.querySelectorAll(".selected");
    for (var k = 0; k < prev.length; k++) prev[k].classList.remove("selected");
    var cellEl = document.getElementById("cell-" + i);
    if (cellEl) cellEl.classList.add("selected");
    var li = document.getElementById("op-" + i);
    if (li) li.classList.add("selected");
    var op = data.ops[i];
    document.getElementById("detail-title").textContent = "Op " + i + ": " + op[1] + " — " + op[2].replace("_", " ");
    var body = document.getElementById("detail-body");
    while (body.firstChild) body.removeChild(body.firstChild);
    if (data.families.length === 0) body.appendChild(el("p", "missing", "No family of this run describes its state to observers."));
    data.families.forEach(function (f) { body.appendChild(familyPanel(f, i)); });
    document.getElementById("detail").setAttribute("data-rendered-op", String(i));
    data.selected = i;
  }

  function opOf(t) {
    while (t && t.getAttribute) {
      var v = t.getAttribute("data-op");
      if (v !== null) return parseInt(v, 10);
      t = t.parentNode;
    }
    return NaN;
  }
  document.getElementById("timeline-svg").addEventListener("click", function (e) { select(opOf(e.target)); });
  document.getElementById("ops").addEventListener("click", function (e) { select(opOf(e.target)); });
  document.addEventListener("keydown", function (e) {
    if (e.key === "ArrowRight") select(data.selected + 1);
    if (e.key === "ArrowLeft") select(data.selected - 1);
  });

  if (data.fail_at !== null) {
    var f = document.getElementById("cell-" + data.fail_at);
    f.setAttribute("data-marked", "first-failure");
    var scroller = f.closest(".scroll");
    var cw = parseInt(document.getElementById("timeline-svg").getAttribute("data-cell-width"), 10);
    if (scroller) scroller.scrollLeft = Math.max(0, 90 + data.fail_at * cw - scroller.clientWidth / 2);
  }
  select(data.selected);
  // Milliseconds from navigation start to the pictures drawn and laid out (reading offsetHeight forces the layout).
  void document.body.offsetHeight;
  document.body.setAttribute("data-render-ms", String(Math.round(performance.now())));
})();
