// Draws the selected op's pictures from the page's data (the element `kvsim-data`); marks the failing cell.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("kvsim-data").textContent);
  var NS = "http://www.w3.org/2000/svg";
  var SHOWN = 96; // columns drawn at each end of a very long window

  function el(tag, cls, txt) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (txt !== undefined) e.textContent = txt;
    return e;
  }
  function hue(req) { return "hsl(" + ((req * 67) % 360) + ",70%,78%)"; }

  function tokenCells(layer, row) {
    var box = el("div", "tokens");
    var cols = [];
    layer.tokens.forEach(function (run) {
      for (var k = 0; k < run.n; k++) cols.push({ run: run, k: k });
    });
    function cell(c, i) {
      var r = c.run, s;
      if (r.kind === "tok") {
        s = el("span", "tok" + (r.expected ? "" : " unexpected") + (r.named ? " named" : ""), (r.req === row.req ? "" : "r" + r.req + ":") + (r.pos + c.k));
        s.style.background = hue(r.req);
        s.title = "temporal column " + i + ": request " + r.req + ", position " + (r.pos + c.k) +
          (r.expected ? "" : " (out of the row's own order)") + (r.named ? " — the column the failing check names" : "");
      } else {
        s = el("span", r.kind + (r.expected ? "" : " unexpected") + (r.named ? " named" : ""), r.kind === "pad" ? "pad" : r.kind === "zero" ? "0" : "?");
        s.title = "temporal column " + i + ": " + (r.kind === "pad" ? "padding poison" : r.kind === "zero" ? "zeros" : "bytes of no admitted request's token");
      }
      return s;
    }
    if (cols.length > 2 * SHOWN) {
      for (var i = 0; i < SHOWN; i++) box.appendChild(cell(cols[i], i));
      box.appendChild(el("span", "gap", "… " + (cols.length - 2 * SHOWN) + " more …"));
      for (var j = cols.length - SHOWN; j < cols.length; j++) box.appendChild(cell(cols[j], j));
    } else {
      cols.forEach(function (c, i) { box.appendChild(cell(c, i)); });
    }
    if (cols.length === 0) box.appendChild(el("span", "gap", "(empty)"));
    return box;
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
    snap.stages.forEach(function (st, k) {
      var sd = el("div", "stage");
      sd.id = "stage-" + fam.name + "-" + k;
      sd.appendChild(el("h4", "", "State " + st.source + " · batch rows (request per row): [" + st.batch.join(", ") + "]"));
      var calls = el("ol", "calls");
      st.calls.forEach(function (c) { calls.appendChild(el("li", "", c)); });
      if (st.calls.length === 0) calls.appendChild(el("li", "", "(no production call)"));
      sd.appendChild(calls);
      st.rows.forEach(function (row) {
        var r = el("div", "row");
        r.id = "row-" + fam.name + "-" + k + "-" + row.req;
        r.appendChild(el("h4", "", "request " + row.req + " · " + row.home + " · offset " + row.offset));
        row.layers.forEach(function (layer) {
          var line = el("div", "layer");
          line.id = "ring-" + fam.name + "-" + k + "-r" + row.req + "-l" + layer.layer;
          line.appendChild(el("span", "lbl", "layer " + layer.layer));
          if (layer.ssm) {
            var s = layer.ssm;
            line.appendChild(el("span", "", "conv state " + s.conv + " #" + s.conv_digest + (s.conv_changed ? " (changed)" : " (unchanged)") +
              " · recurrent state " + s.rec + " #" + s.rec_digest + (s.rec_changed ? " (changed)" : " (unchanged)")));
          } else {
            line.appendChild(tokenCells(layer, row));
            var w = fam.window === null ? "linear" : "window " + fam.window;
            line.appendChild(el("span", "note", "live window " + layer.len + " (" + w + ") · " + layer.storage));
          }
          r.appendChild(line);
          if (layer.planes.length) r.appendChild(el("p", "note", "planes: " + layer.planes.join(" · ")));
        });
        sd.appendChild(r);
      });
      d.appendChild(sd);
    });
    if (snap.missing) d.appendChild(el("p", "missing", snap.missing));
    if (fam.kind === "kv") {
      d.appendChild(el("p", "note", "Temporal order, oldest first; tokens identified from the K bytes (self-identifying values); " +
        "a red outline: out of the row's own order; a black frame: the column the failing check names. " +
        "Physical columns, write head, left padding and masks are not handed to observers (see Not observable)."));
    } else {
      d.appendChild(el("p", "note", "Recurrent rows: offset = positions fed; the round and the spans are in the calls above."));
    }
    return d;
  }

  function select(i) {
    if (isNaN(i) || i < 0 || i >= data.ops.length) return;
    var prev = document.querySelectorAll(".selected");
    for (var k = 0; k < prev.length; k++) prev[k].classList.remove("selected");
    var cell = document.getElementById("cell-" + i);
    if (cell) cell.classList.add("selected");
    var li = document.getElementById("op-" + i);
    if (li) li.classList.add("selected");
    var op = data.ops[i];
    document.getElementById("detail-title").textContent = "Op " + i + ": " + op.text + " — " + op.status.replace("_", " ");
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
  document.body.setAttribute("data-render-ms", String(Math.round(performance.now())));
})();
