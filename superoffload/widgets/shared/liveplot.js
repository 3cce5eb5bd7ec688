// so-liveplot-esm: the browser side of `LivePlot` (superoffload/widgets/shared/liveplot.py).
// A one-way plotly view: the kernel assigns the figure (arrays as binary buffers) to one
// trait; this module draws the newest figure whenever the view is on screen.
//
// plotly.js is not in this module (it would make it 4.8 MB, and anywidget gives a model 2 s
// to import its module and initialize: a throttled or busy page took 9-12 s). It is loaded
// once per page from a `PlotlyLibrary` model (a core widget holding the bundle's bytes),
// evaluated once and shared by every view through `globalThis` (docs/jupyter.md, "How the
// live figure draws").
const DRAW_TIMEOUT_MS = __DRAW_TIMEOUT_MS__;
const VISIBLE_MARGIN_PX = __VISIBLE_MARGIN_PX__;
const PLOTLY_KEY = "__superoffload_plotly_" + "__PLOTLY_VERSION__";
const WIDGET_MIME = "application/vnd.jupyter.widget-view+json";
const PLOTLY_MIME = "application/vnd.plotly.v1+json";
const OUR_VIEWS = ["so-dashboard", "so-trainer", "so-trainer-live", "so-tuner", "so-calibration"];

// ---------------------------------------------------------------- plotly, once per page
function evaluate(bytes) {
  // the bundle is UMD: given a CommonJS-like `module` it exports Plotly instead of a global
  const src = new TextDecoder().decode(bytes);
  const js = "const module = { exports: {} };\n(function (module) {\n" + src +
             "\n})(module);\nexport default module.exports;\n";
  const url = URL.createObjectURL(new Blob([js], { type: "text/javascript" }));
  return import(url).then((m) => { URL.revokeObjectURL(url); return m.default; });
}

async function warmUp(Plotly) {
  // one tiny plot off screen: plotly's one-time set-up (fonts, defs, the trace modules'
  // first use) is paid now, not by the first figure with data
  const d = document.createElement("div");
  d.style.cssText = "position:fixed;left:-10000px;top:0;width:120px;height:80px";
  document.body.appendChild(d);
  try {
    await Plotly.newPlot(d, [{ x: [0, 1], y: [0, 1], mode: "lines" }],
                         { width: 120, height: 80, margin: { l: 0, r: 0, t: 0, b: 0 } });
    Plotly.purge(d);
  } catch (e) { /* a warm-up that fails changes nothing */ }
  d.remove();
}

function plotly(model) {
  const g = globalThis;
  if (!g[PLOTLY_KEY]) {
    g[PLOTLY_KEY] = (async () => {
      const t0 = Date.now();
      const lib = await model.widget_manager.get_model(model.get("library"));
      const p = await evaluate(lib.get("source"));
      await warmUp(p);
      PAGE.plotlyLoad = { started: t0, ready: Date.now() };  // for tests: when, how long
      return p;
    })();
    g[PLOTLY_KEY].catch(() => { delete g[PLOTLY_KEY]; });  // a later view tries again
  }
  return g[PLOTLY_KEY];
}

// ---------------------------------------------------------------- the figure's arrays
function typed(dv, ref) {
  // a binary frame as a typed array (copied: a DataView into a message need not be aligned
  // for a Float32Array); a 2-D array as one row per point (customdata)
  const raw = dv.buffer.slice(dv.byteOffset, dv.byteOffset + dv.byteLength);
  const flat = ref.dtype === "f8" ? new Float64Array(raw) : new Float32Array(raw);
  if (ref.shape.length < 2) return flat;
  const k = ref.shape[1];
  return Array.from({ length: ref.shape[0] }, (_, i) => flat.subarray(i * k, i * k + k));
}

function unpack(packed) {
  // {json, arrays} (plotjson.pack): the JSON with each {"$a": k, ...} replaced by array k
  if (!packed || !packed.json) return {};
  const arrays = packed.arrays || [];
  return JSON.parse(new TextDecoder().decode(packed.json),
                    (key, v) => (v && typeof v === "object" && "$a" in v
                                 ? typed(arrays[v["$a"]], v) : v));
}

function plain(value) {
  // a figure as JSON for a static output (typed arrays become plain arrays; NaN -> null)
  if (ArrayBuffer.isView(value)) return Array.from(value, (v) => (Number.isFinite(v) ? v : null));
  if (Array.isArray(value)) return value.map(plain);
  if (value && typeof value === "object") {
    const out = {};
    for (const [k, v] of Object.entries(value)) out[k] = plain(v);
    return out;
  }
  return value;
}

// ---------------------------------------------------------------- frozen in the notebook
// When the kernel restarts or dies the front-end drops everything the old kernel still
// sends, so the kernel cannot replace its live views by snapshots then. This page still can:
// every live view of ours in the notebook becomes a static output (the dashboard its figure,
// the others their text), so a notebook saved afterwards reopens without "model not found".
const PAGE = (globalThis.__superoffload_page = globalThis.__superoffload_page ||
              { figures: new Map(), watched: new WeakSet(), firstData: new Map() });
const hasData = (fig) => (fig.data || []).some((t) => t.x && t.x.length);

async function freezeNotebook(manager, note, only) {
  const cells = manager && manager.context && manager.context.model &&
                manager.context.model.cells;
  if (!cells) return 0;
  const found = [];
  for (let i = 0; i < cells.length; i++) {
    const outputs = cells.get(i).outputs;
    for (let j = 0; outputs && j < outputs.length; j++) {
      const ref = (outputs.get(j).data || {})[WIDGET_MIME];
      if (ref && ref.model_id && (!only || only === ref.model_id)) found.push(ref.model_id);
    }
  }
  let frozen = 0;
  for (const id of found) {
    const bundle = await staticBundle(manager, id, note).catch(() => null);
    if (!bundle) continue;
    // found again now: the notebook may have changed while the text was read
    for (let i = 0; i < cells.length; i++) {
      const outputs = cells.get(i).outputs;
      for (let j = 0; outputs && j < outputs.length; j++) {
        const ref = (outputs.get(j).data || {})[WIDGET_MIME];
        if (ref && ref.model_id === id) {
          outputs.set(j, { output_type: "display_data", data: bundle, metadata: {} });
          frozen++;
        }
      }
    }
  }
  return frozen;
}

async function staticBundle(manager, id, note) {
  const m = await manager.get_model(id);
  const classes = m.get("_dom_classes") || [];
  if (!OUR_VIEWS.some((c) => classes.includes(c))) return null;  // not ours: left alone
  let text = "";
  for (const p of Object.values(m.views || {})) {
    const v = await p;
    if (v && v.el) { text = v.el.textContent.replace(/\s+/g, " ").trim(); break; }
  }
  const lines = [text || "(a live view)", `(${note})`];
  const bundle = {
    "text/html": "<div class='so-snapshot'>" + lines.map(escapeHtml).join("<br>") + "</div>",
    "text/plain": lines.join("\n"),
  };
  const figure = PAGE.figures.get(id);
  if (figure) bundle[PLOTLY_MIME] = figure();
  return bundle;
}

function escapeHtml(s) {
  return String(s).replace(/[&<>'"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
                                                 "'": "&#39;", '"': "&quot;" }[c]));
}

function watchKernel(manager) {
  const sc = manager && manager.context && manager.context.sessionContext;
  if (!sc || !sc.statusChanged || PAGE.watched.has(manager)) return;
  PAGE.watched.add(manager);
  const freeze = (why) => freezeNotebook(manager, `frozen here when the kernel ${why}`)
    .catch(() => {});
  sc.statusChanged.connect((_, status) => {
    const why = { restarting: "restarted", autorestarting: "died", dead: "died" }[status];
    if (why) freeze(why);
  });
  // shut down from the page: the kernel freezes its views itself, but a page that is slow
  // to read its last messages loses them when the connection goes; freeze what is left
  sc.kernelChanged.connect((_, change) => { if (!change.newValue) freeze("shut down"); });
}

// ---------------------------------------------------------------- the model
async function initialize({ model }) {
  // tell the kernel this model started (its fallback figure is not needed); nothing here
  // waits: anywidget fails a model whose initialize takes over 2 s
  model.send({ event: "initialized" });
  const manager = model.widget_manager;
  watchKernel(manager);
  const box = model.get("box");
  if (box) {
    PAGE.figures.set(box, () => {
      const fig = unpack(model.get("figure"));
      return Object.assign(plain({ data: fig.data || [], layout: fig.layout || {} }),
                           { config: model.get("config") || {} });
    });
  }
  // when the first figure with data reached this page (the view measures its first draw
  // from here, even when it is rendered later)
  // keyed by the widget's token: anywidget hands initialize and each view its own proxy
  const stamp = () => {
    const key = model.get("token");
    if (!PAGE.firstData.has(key) && hasData(unpack(model.get("figure")))) {
      PAGE.firstData.set(key, Date.now());
    }
  };
  model.on("change:figure", stamp);
  stamp();
  // start loading plotly now, in a later task (the first figure may need it in seconds)
  setTimeout(() => plotly(model).catch(() => {}), 0);
}

// ---------------------------------------------------------------- one view
function render({ model, el }) {
  el.classList.add("so-liveplot");
  const rendered = Date.now();
  const hooks = { react: (div, data, layout, config) => Plotly.react(div, data, layout, config),
                  state: () => ({ visible, dirty, drawing: !!inFlight, scheduled: !!timer }) };
  el.soLivePlot = hooks;
  let Plotly = null;
  let div = null;
  let dirty = true;         // a figure newer than the one drawn is waiting
  let inFlight = null;      // the draw running now: {started, div}
  let visible = false;
  let timer = 0, timerDue = Infinity;
  const count = (key) => { el.dataset[key] = String(Number(el.dataset[key] || 0) + 1); };
  // for tests, where the first data's time goes (ms since the epoch, each step's first
  // time): the view "rendered"; that data waiting "hidden" (off screen) or for "plotly", or
  // "shown" on screen; its draw "drawing" and "drawn" (the browser test prints these)
  const timeline = {};
  const reached = (step) => {
    if (step in timeline || el.dataset.firstDrawnMs) return;
    timeline[step] = Date.now();
    el.dataset.timeline = JSON.stringify(timeline);
  };
  const dataCame = () => PAGE.firstData.has(model.get("token"));
  reached("rendered");

  function freshDiv() {
    const d = document.createElement("div");
    d.style.width = "100%";
    el.appendChild(d);
    return d;
  }
  div = freshDiv();
  liveNow();

  function liveNow() {
    // this view works: hide the dashboard's fallback figure and stop it from drawing
    const box = el.closest(".so-dashboard");
    if (box) box.classList.add("so-live-ok");
    const id = model.get("fallback");
    const manager = model.widget_manager;
    if (!id || !manager) return;
    manager.get_model(id).then((m) => {
      for (const p of Object.values(m.views || {})) Promise.resolve(p).then((v) => v.remove());
    }).catch(() => {});
  }

  function schedule(ms) {  // one timer: the earliest of the pumps asked for
    const due = performance.now() + ms;
    if (timer && due >= timerDue) return;
    clearTimeout(timer);
    timerDue = due;
    timer = setTimeout(() => { timer = 0; timerDue = Infinity; pump(); }, ms);
  }

  function onScreen() {
    // the element's box decides: the observer only wakes the pump when the view comes into
    // sight (its first report can precede the cell's layout under JupyterLab's windowing)
    if (!el.isConnected) return (visible = false);
    const r = el.getBoundingClientRect();
    visible = r.width > 0 && r.bottom > -VISIBLE_MARGIN_PX &&
              r.top < window.innerHeight + VISIBLE_MARGIN_PX;
    if (visible && dataCame()) reached("shown");
    return visible;
  }

  function pump() {
    if (!dirty) return;
    if (!onScreen()) { el.dataset.pending = "hidden"; if (dataCame()) reached("hidden"); return; }
    if (!Plotly) {  // loading: drawn when it is
      el.dataset.pending = "plotly";
      if (dataCame()) reached("plotly");
      return;
    }
    if (inFlight) {
      const waited = performance.now() - inFlight.started;
      if (waited < DRAW_TIMEOUT_MS) { schedule(DRAW_TIMEOUT_MS - waited + 20); return; }
      // a draw that never settled: abandon its element, draw the newest figure afresh
      count("stalls");
      const stale = inFlight.div;
      inFlight = null;
      try { Plotly.purge(stale); } catch (e) { /* it may be half-built */ }
      stale.remove();
      div = freshDiv();
    }
    dirty = false;
    delete el.dataset.pending;
    const fig = unpack(model.get("figure"));
    const mine = { started: performance.now(), div: div };
    if (hasData(fig)) reached("drawing");
    inFlight = mine;
    let drawn;
    try {
      drawn = Promise.resolve(hooks.react(div, fig.data || [], fig.layout || {},
                                          model.get("config") || {}));
    } catch (e) {
      drawn = Promise.reject(e);
    }
    drawn.then(() => {
      if (inFlight !== mine) return;  // abandoned meanwhile: its figure was drawn again
      count("draws");
      el.dataset.drawMs = String(Math.round(performance.now() - mine.started));
      if (hasData(fig) && !el.dataset.firstDrawnMs) {
        reached("drawn");
        // seconds from the first data to its first draw: what the browser test measures
        // from the later of the data's arrival and this view's start: a view shown after
        // its data came (the dashboard in the last cell) cannot draw before it exists
        const arrived = Math.max(PAGE.firstData.get(model.get("token")) || 0, rendered);
        el.dataset.firstDataMs = String(PAGE.firstData.get(model.get("token")) || rendered);
        el.dataset.renderedMs = String(rendered);
        el.dataset.firstDrawnMs = String(Date.now());
        el.dataset.dataToDrawMs = String(Date.now() - arrived);
        if (PAGE.plotlyLoad) {
          el.dataset.plotlyStartedMs = String(PAGE.plotlyLoad.started);
          el.dataset.plotlyReadyMs = String(PAGE.plotlyLoad.ready);
        }
        keepInView();
      }
    }, (e) => {
      if (inFlight === mine) el.dataset.drawError = String(e && e.message || e);
    }).finally(() => {
      if (inFlight !== mine) return;
      inFlight = null;
      if (dirty) schedule(0);
    });
    watchdog(mine);
  }

  function watchdog(draw) {  // pump() again if this draw never settles
    setTimeout(() => { if (inFlight === draw) { dirty = true; pump(); } }, DRAW_TIMEOUT_MS + 20);
  }

  function keepInView() {
    // Once, after the first figure with data: if this view's cell is the active one (Run All
    // leaves the last cell active and in view), the figure's own growth must not push the
    // view's bottom out of sight. A view in any other cell never scrolls the notebook.
    el.dataset.settled = "1";
    const cell = el.closest(".jp-Cell");
    if (cell && cell.classList.contains("jp-mod-active")) {
      (el.closest(".so-dashboard") || el).scrollIntoView({ block: "nearest" });
    }
  }

  function figureChanged() {
    // drawn in this very task when nothing is drawing or waiting (a timer's task would queue
    // behind every message a busy page has yet to read: seconds on a throttled page); a
    // figure that comes while one is drawing waits for it, and the newest is drawn next
    dirty = true;
    if (!inFlight && !timer) pump();
    else schedule(0);
  }
  model.on("change:figure", figureChanged);
  model.on("change:config", figureChanged);
  figureChanged();
  if (model.get("ended")) {
    // the run ended while no page showed this notebook (its snapshot went nowhere): this
    // view was rendered again from the kernel's live models; leave a static output instead
    setTimeout(() => freezeNotebook(model.widget_manager, "the run had ended; frozen when " +
                                    "this notebook was opened again", model.get("box"))
      .catch(() => {}), 2000);
  }

  plotly(model).then(
    (p) => { Plotly = p; hooks.plotly = p; if (!inFlight) pump(); },
    (e) => { el.dataset.drawError = "plotly.js: " + String(e && e.message || e); });

  const seen = new IntersectionObserver((entries) => {
    if (entries[entries.length - 1].isIntersecting) schedule(0);
  }, { rootMargin: `${VISIBLE_MARGIN_PX}px` });
  seen.observe(el);
  const resize = new ResizeObserver(() => {
    if (dirty) schedule(0);  // laid out at last (a cell re-attached, a panel resized)
    if (!Plotly || !visible || inFlight || !div.data) return;
    Promise.resolve(Plotly.Plots.resize(div)).catch(() => {});  // rejects when hidden
  });
  resize.observe(el);
  return () => {
    seen.disconnect();
    resize.disconnect();
    clearTimeout(timer);
    if (Plotly) { try { Plotly.purge(div); } catch (e) { /* already gone */ } }
  };
}

export default { initialize, render };
