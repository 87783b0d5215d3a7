// vlmod demo page: plain JavaScript, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  limits: null,
  model: null,         // /api/health "model"
  source: null,        // {file: File} | {example: name}
  result: null,
  frame: 0,            // selected image / frame
  part: "language",    // "language" | "vision"
  view: 0,             // index into media[frame].views
  layer: 0,            // 0 = all MoD layers (counts), k = k-th MoD layer's mask
  pixels: "sharp",     // "sharp": the crop as uploaded | "model": the pixels at the model's resolution
  pixelsChosen: false, // the user picked a view: keep it for later results
  images: [],          // decoded <img> per media item (the crop, sharp)
  modelImages: [],     // decoded <img> per media item (the crop at the model's resolution)
  originals: [],       // <img> per media item: the whole picture as the server decoded it, or null
  generation: 0,       // bumps on every run, so a late answer never paints over a newer state
  playing: 0,          // setInterval id while a clip plays, else 0
};

// ----------------------------------------------------------------------------- overlay style

// Readable on any picture: skipped tokens are dimmed, tokens that ran at every MoD layer are
// outlined in Okabe-Ito sky blue on a dark halo (colour-blind safe, visible on bright and dark
// scenes alike). Brightness and outline carry the meaning, not hue alone. The veil has at most four
// levels, far enough apart to tell on a photo: ran everywhere (none), at half the MoD layers or
// more, at fewer than half, nowhere.
const RUN_EDGE = "#56B4E9";
const HALO = "rgba(0, 0, 0, 0.85)";
const DIM_MAX = 0.78;    // opacity of the black veil over a token no MoD layer ran
const DIM_MOST = 0.28;   // ran at half the MoD layers or more (not all)
const DIM_FEW = 0.55;    // ran at fewer than half (not none)

function dimFor(count, n) {
  if (!n || count >= n) return 0;
  if (count <= 0) return DIM_MAX;
  return 2 * count >= n ? DIM_MOST : DIM_FEW;
}

// ----------------------------------------------------------------------------- formatting

function pct(x, digits = 0) { return `${(100 * x).toFixed(digits)}%`; }

function flops(x) {
  const units = [["T", 1e12], ["G", 1e9], ["M", 1e6], ["k", 1e3]];
  for (const [u, v] of units) if (x >= v) return `${(x / v).toFixed(x / v >= 100 ? 0 : 1)} ${u}FLOPs`;
  return `${x.toFixed(0)} FLOPs`;
}

function seconds(s) { return s >= 1 ? `${s.toFixed(2)} s` : `${(1000 * s).toFixed(s < 0.01 ? 1 : 0)} ms`; }

function el(tag, props = {}, children = []) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

const sum = (xs) => xs.reduce((a, b) => a + b, 0);

// ----------------------------------------------------------------------------- status

function setStatus(message, kind = "") {
  const s = $("status");
  s.className = `status ${kind}`;
  s.textContent = "";
  if (kind === "busy") s.append(el("span", { class: "spinner", "aria-hidden": "true" }));
  s.append(message);
}

function updateRunButton() {
  $("run").disabled = !state.source || !$("prompt").value.trim() || document.body.dataset.state === "busy";
}

// ----------------------------------------------------------------------------- input

// A new choice (a file, an example, or a refused file) replaces everything about the old one: its
// result, its error, its selection, so nothing on screen describes a file that is not chosen.
function resetChoice() {
  state.generation++;  // an answer still on its way belongs to the old choice
  clearResult();
  $("result-error").hidden = true;
  $("empty").hidden = false;
  document.body.dataset.state = "idle";
  setStatus("");
}

function chooseFile(file) {
  if (!file) return;
  resetChoice();
  const limit = state.limits ? state.limits.max_upload_bytes : Infinity;
  if (file.size > limit) {
    clearChoice();
    setStatus(`That file is ${(file.size / 2 ** 20).toFixed(1)} MB; the demo takes up to ${(limit / 2 ** 20).toFixed(0)} MB. Choose a smaller one.`, "error");
    return;
  }
  state.source = { file };
  markExample(null);
  showPreview(file.type.startsWith("video") ? null : URL.createObjectURL(file), file.name,
    `${(file.size / 1024).toFixed(0)} KB · ${file.type || "unknown type"}`);
  updateRunButton();
}

// Nothing chosen: Run cannot analyse a file that was refused, nor the one before it.
function clearChoice() {
  state.source = null;
  markExample(null);
  $("file").value = "";
  const preview = $("dz-preview");
  preview.textContent = "";
  preview.hidden = true;
  $("dz-title").textContent = "Drop an image or a video";
  $("dz-hint").textContent = dropHint();
  $("dropzone").classList.remove("has-file");
  updateRunButton();
}

function dropHint() {
  const limit = state.limits ? ` · up to ${(state.limits.max_upload_bytes / 2 ** 20).toFixed(0)} MB` : "";
  return `or click to choose a file${limit}`;
}

function showPreview(url, title, hint) {
  const preview = $("dz-preview");
  preview.textContent = "";
  preview.hidden = false;
  if (url) {
    // A file the browser cannot show (not a picture, or corrupt) gets a plain file icon, never a
    // broken-image glyph.
    const img = el("img", { src: url, alt: "" });
    img.addEventListener("error", () => { img.replaceWith(el("span", { class: "file-icon", "aria-hidden": "true" })); });
    preview.append(img);
  } else {
    preview.append(el("span", { class: "play", "aria-hidden": "true" }));
  }
  $("dz-title").textContent = title;
  $("dz-hint").textContent = hint;
  $("dropzone").classList.add("has-file");
}

function markExample(name) {
  for (const b of document.querySelectorAll(".example")) b.classList.toggle("selected", b.dataset.name === name);
}

async function loadExamples() {
  const res = await fetch("/api/examples");
  const { examples } = await res.json();
  const box = $("examples");
  box.textContent = "";
  for (const ex of examples) {
    const thumb = ex.kind === "video"
      ? el("video", { src: ex.url, muted: "", playsinline: "", loop: "", autoplay: "", preload: "auto" })
      : el("img", { src: ex.url, alt: "" });
    if (ex.kind === "video") thumb.muted = true;
    const button = el("button", {
      class: "example", type: "button", title: ex.prompt, "data-name": ex.name,
      onclick: () => {
        resetChoice();
        state.source = { example: ex.name };
        markExample(ex.name);
        $("prompt").value = ex.prompt;
        showPreview(ex.kind === "video" ? null : ex.url, ex.name.replace(/-/g, " "), `${ex.kind} · expected answer: ${ex.answer}`);
        updateRunButton();
      },
    }, [thumb, el("span", { class: "example-badge", text: ex.kind === "video" ? "video" : "image" })]);
    box.append(button);
  }
  if (!examples.length) box.append(el("span", { class: "muted", text: "no examples bundled" }));
}

async function loadHealth() {
  try {
    const res = await fetch("/api/health");
    const h = await res.json();
    state.limits = h.limits;
    if (h.limits.max_prompt_chars) $("prompt").maxLength = h.limits.max_prompt_chars;  // the server's own limit
    const m = h.model;
    state.model = m;
    const mod = m.mod_layers.language || [];
    const parts = [`${m.architecture.replace("ForConditionalGeneration", "")}`,
      `${mod.length}/${m.language_layers} MoD layers`];
    if ((m.mod_layers.vision || []).length) parts.push("vision tower routed");
    if (m.dense) parts.push("dense baseline");
    $("model-info").textContent = parts.join(" · ");
    $("model-info").title = `${m.name}: ${(m.parameters / 1e6).toFixed(2)} M parameters`;
    if (!state.source) $("dz-hint").textContent = dropHint();
    if (m.about) {
      $("about-model").hidden = false;
      $("about-model").classList.toggle("embedded", Boolean(m.about.embedded));
      $("about-summary").textContent = m.about.summary;
      $("about-knows").textContent = m.about.knows;
      $("about-knows").hidden = !m.about.knows;
    }
  } catch (err) {
    $("model-info").textContent = "server unreachable";
  }
}

// ----------------------------------------------------------------------------- run

function clearResult() {
  stopPlaying();
  state.result = null;
  state.images = [];
  state.modelImages = [];
  $("output").hidden = true;
  $("latency").hidden = true;
  $("latency").textContent = "";
  $("stats").textContent = "";
  delete $("stats").dataset.ready;
  delete $("stage").dataset.drawn;
}

function showError(message) {
  clearResult();
  $("empty").hidden = true;
  $("result-error").hidden = false;
  $("result-error-message").textContent = message;
  setStatus("");  // the message is shown once, in the result panel
  document.body.dataset.state = "error";
  // Where the user looks: on a phone the result panel is below the fold.
  $("result-error").scrollIntoView({ block: "nearest", behavior: "smooth" });
}

async function run() {
  if (!state.source) return;
  const prompt = $("prompt").value.trim();
  if (!prompt) { setStatus("Type a prompt first.", "error"); return; }
  const form = new FormData();
  form.append("prompt", prompt);
  if (state.source.file) form.append("file", state.source.file);
  else form.append("example", state.source.example);
  const generation = ++state.generation;
  const source = state.source;
  document.body.dataset.state = "busy";
  $("result-error").hidden = true;
  $("result").classList.add("stale");
  updateRunButton();
  setStatus("Running the model…", "busy");
  const started = performance.now();
  try {
    const res = await fetch("/api/analyze", { method: "POST", body: form });
    let data;
    try { data = await res.json(); } catch { data = { error: `the server answered ${res.status} ${res.statusText}` }; }
    if (!res.ok) throw new Error(data.error || `the server answered ${res.status}`);
    if (generation !== state.generation) return;
    await show(data, source);
    setStatus(`Done in ${seconds((performance.now() - started) / 1000)}.`, "ok");
    document.body.dataset.state = "done";
    const top = $("result").getBoundingClientRect().top;
    if (top > window.innerHeight * 0.8) $("result").scrollIntoView({ block: "start", behavior: "smooth" });
  } catch (err) {
    if (generation !== state.generation) return;
    showError(err instanceof TypeError ? `The server could not be reached (${err.message}).` : err.message);
  } finally {
    $("result").classList.remove("stale");
    updateRunButton();
  }
}

function loadImage(src) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error("the browser could not display the picture the server sent"));
    img.src = src;
  });
}

async function show(result, source) {
  // Per picture: the crop, its pixels at each grid's model resolution, and the whole picture as
  // the server decoded it (EXIF orientation applied there), on which the crop is outlined.
  const [images, modelImages, originals] = await Promise.all([
    Promise.all(result.media.map((m) => loadImage(m.src))),
    Promise.all(result.media.map(async (m) => {
      const base = await loadImage(m.model_src);
      return Promise.all(m.views.map((v) => (v.model_src ? loadImage(v.model_src) : base)));
    })),
    Promise.all(result.media.map((m) => (m.original.src ? loadImage(m.original.src) : null))),
  ]);
  state.result = result;
  state.images = images;
  state.modelImages = modelImages;
  state.originals = originals;
  state.frame = 0;
  state.view = 0;
  state.layer = 0;
  // Photos and video frames read clearly only sharp; a bundled example is as small as the model's
  // input, so its own pixels are the honest view. A view the user picked stays picked.
  if (!state.pixelsChosen) state.pixels = source && source.file ? "sharp" : "model";
  if (state.part === "vision" && !result.media[0].vision) state.part = "language";
  $("empty").hidden = true;
  $("result-error").hidden = true;
  $("output").hidden = false;
  renderAnswer(source);
  renderLatency();
  renderToggles();
  renderStats();
  renderStrip();
  renderFrameControls();
  redraw();
}

// ----------------------------------------------------------------------------- drawing

function currentGrid(item) {
  if (state.part === "vision" && item.vision) return item.vision;
  return item.views[Math.min(state.view, item.views.length - 1)];
}

function modLayers() {
  const r = state.result;
  return state.part === "vision" ? r.layers.vision : r.layers.language;
}

function pictureFor(k) {
  if (state.pixels !== "model") return state.images[k];
  const views = state.modelImages[k];
  return state.part === "vision" ? views[0] : views[Math.min(state.view, views.length - 1)];
}

function drawOverlay(canvas, img, grid, width, outline = true) {
  const ratio = window.devicePixelRatio || 1;
  const height = Math.round(width * img.naturalHeight / img.naturalWidth);
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  // The model's pixels are drawn as blocks, so each token covers whole pixels of its patch.
  ctx.imageSmoothingEnabled = state.pixels !== "model";
  ctx.imageSmoothingQuality = "high";
  ctx.drawImage(img, 0, 0, width, height);
  const cw = width / grid.cols;
  const ch = height / grid.rows;
  const nMod = grid.masks.length;
  const layer = state.layer;
  const ran = [];
  for (let i = 0; i < grid.rows * grid.cols; i++) {
    const count = layer === 0 ? grid.counts[i] : grid.masks[layer - 1][i] * nMod;
    const dim = dimFor(count, nMod);
    const x = (i % grid.cols) * cw, y = Math.floor(i / grid.cols) * ch;
    if (dim > 0) {
      ctx.fillStyle = `rgba(0, 0, 0, ${dim.toFixed(3)})`;
      ctx.fillRect(x, y, cw, ch);
    }
    if (count === nMod) ran.push([x, y]);
  }
  if (outline && ran.length) {
    const line = Math.max(1, Math.min(2.5, Math.min(cw, ch) / 10));
    for (const [stroke, w] of [[HALO, line + 2], [RUN_EDGE, line]]) {
      ctx.strokeStyle = stroke;
      ctx.lineWidth = w;
      ctx.beginPath();
      const inset = line / 2 + 1;
      for (const [x, y] of ran) ctx.rect(x + inset, y + inset, cw - 2 * inset, ch - 2 * inset);
      ctx.stroke();
    }
  }
  canvas.dataset.drawn = "1";
}

function stageWidth() {
  const wrap = document.querySelector(".stage-wrap");
  const styles = getComputedStyle(wrap);
  const inner = wrap.clientWidth - parseFloat(styles.paddingLeft) - parseFloat(styles.paddingRight);
  return Math.max(120, Math.min(560, inner));
}

function redraw() {
  const r = state.result;
  if (!r) return;
  const item = r.media[state.frame];
  const grid = currentGrid(item);
  const layers = modLayers();
  const slider = $("layer");
  slider.max = String(grid.masks.length);
  slider.value = String(state.layer);
  renderTicks(layers);
  drawOverlay($("stage"), pictureFor(state.frame), grid, stageWidth());
  renderLayerLabel(grid, layers);
  renderLegend(grid);
  renderSeen(item, grid);
  updateFrameControls();
  // The strip counts what the slider selects: token-layer passes over all MoD layers, or one layer's tokens.
  $("strip-what").textContent = state.layer === 0
    ? "vision token-layer passes run (all MoD layers)" : `vision tokens run in layer L${layers.mod[state.layer - 1]}`;
  for (const card of document.querySelectorAll(".frame-card")) {
    const k = Number(card.dataset.index);
    card.classList.toggle("selected", k === state.frame);
    card.setAttribute("aria-current", String(k === state.frame));
    const g = currentGrid(r.media[k]);
    drawOverlay(card.querySelector("canvas"), pictureFor(k), g, card.clientWidth - 2 || 120, false);
    const [run, total] = tokensRun(g);
    card.querySelector(".frame-count").textContent = `${run}/${total}`;
    card.querySelector(".bar span").style.width = `${(100 * run / Math.max(1, total)).toFixed(1)}%`;
  }
}

// Tokens that ran in the selected layer (or token-layer passes over all MoD layers) of a grid.
function tokensRun(grid) {
  const n = grid.rows * grid.cols;
  if (state.layer === 0) return [sum(grid.counts), n * grid.masks.length];
  return [sum(grid.masks[state.layer - 1]), n];
}

function renderTicks(layers) {
  const ticks = $("ticks");
  const labels = ["All", ...layers.mod.map((i) => `L${i}`)];
  if (ticks.dataset.labels === labels.join()) return;
  ticks.dataset.labels = labels.join();
  ticks.textContent = "";
  labels.forEach((text, k) => ticks.append(el("button", {
    type: "button", text, onclick: () => { state.layer = k; redraw(); },
  })));
}

function renderLayerLabel(grid, layers) {
  $("layer-heading").textContent = state.part === "vision" ? "Vision-tower layer" : "Language-model layer";
  const label = $("layer-label");
  const what = state.part === "vision" ? "vision-tower" : "language";
  label.textContent = "";
  if (state.layer === 0) {
    label.append(el("b", { text: `All ${layers.mod.length} MoD layers` }),
      ` of ${layers.total} ${what} layers · the darker a token, the more MoD layers skipped it`);
    return;
  }
  const idx = layers.mod[state.layer - 1];
  const mask = grid.masks[state.layer - 1];
  const ran = sum(mask);
  label.append(el("b", { text: `Layer ${idx}` }),
    ` of ${layers.total} · ${ran} of ${mask.length} tokens processed (${pct(ran / mask.length)}) in this grid`);
}

function swatch(dim, outlined) {
  return el("span", { class: `swatch${outlined ? " run" : ""}`, style: `--dim: ${dim.toFixed(3)}` });
}

function renderLegend(grid) {
  const legend = $("legend");
  legend.textContent = "";
  const n = grid.masks.length;
  if (state.layer === 0 && n > 1) {
    const half = Math.ceil(n / 2);
    legend.append(el("span", { class: "key" }, [swatch(0, true), `ran at all ${n} MoD layers`]));
    legend.append(el("span", { class: "key" }, [swatch(DIM_MOST, false),
      half === n - 1 ? `ran at ${half} of ${n}` : `ran at ${half} to ${n - 1} of ${n}`]));
    if (half > 1) {
      legend.append(el("span", { class: "key" }, [swatch(DIM_FEW, false),
        half === 2 ? `ran at 1 of ${n}` : `ran at 1 to ${half - 1} of ${n}`]));
    }
    legend.append(el("span", { class: "key" }, [swatch(DIM_MAX, false), "skipped at every MoD layer"]));
  } else {
    legend.append(
      el("span", { class: "key" }, [swatch(0, true), "processed (attention + MLP)"]),
      el("span", { class: "key" }, [swatch(DIM_MAX, false), "skipped (rides the residual)"]),
    );
  }
}

// What the model saw: the crop of the picture and the resolution it took it in.
function renderSeen(item, grid) {
  const note = $("seen-note");
  const o = item.original, c = item.crop;
  const m = (state.part === "language" && grid.model_size) || item.model_size;
  const cropped = c.width !== o.width || c.height !== o.height;
  const frame = state.result.kind === "video" ? "frame" : "picture";
  const parts = [];
  const yours = item.source
    ? `your ${item.source.width}×${item.source.height} ${frame}, decoded at ${o.width}×${o.height}`
    : `your ${o.width}×${o.height} ${frame}`;
  parts.push(cropped ? `The model saw the centre ${c.width}×${c.height} of ${yours}` : `The model saw ${yours.replace("your ", "your whole ")}`);
  parts.push(`resized to ${m.width}×${m.height} px`);
  const cellW = m.width / grid.cols, cellH = m.height / grid.rows;
  const cell = Number.isInteger(cellW) && Number.isInteger(cellH) ? ` of ${cellW}×${cellH} px` : "";
  const which = grid.name === "tokens" ? "" : ` (${grid.name})`;
  note.textContent = `${parts.join(", ")}: one token per cell of this ${grid.cols}×${grid.rows} grid${cell}${which}.`;
  const thumb = $("crop-thumb");
  const img = state.originals[state.frame];
  thumb.hidden = !(cropped && img);
  if (!thumb.hidden) {
    // The picture as the server decoded it (upright, as the model saw it), not the browser's copy
    // of the file: the crop box is in the server's pixels.
    const w = 96, h = Math.round(w * o.height / o.width);
    const ratio = window.devicePixelRatio || 1;
    thumb.width = w * ratio; thumb.height = h * ratio;
    thumb.style.width = `${w}px`; thumb.style.height = `${h}px`;
    const ctx = thumb.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.drawImage(img, 0, 0, w, h);
    const ix = img.naturalWidth / o.width, iy = img.naturalHeight / o.height;
    const sx = w / o.width, sy = h / o.height;
    ctx.fillStyle = "rgba(0, 0, 0, 0.6)";
    ctx.fillRect(0, 0, w, h);
    ctx.drawImage(img, c.x * ix, c.y * iy, c.width * ix, c.height * iy, c.x * sx, c.y * sy, c.width * sx, c.height * sy);
    ctx.strokeStyle = RUN_EDGE;
    ctx.lineWidth = 2;
    ctx.strokeRect(c.x * sx + 1, c.y * sy + 1, c.width * sx - 2, c.height * sy - 2);
  }
}

// ----------------------------------------------------------------------------- wiring

function init() {
  $("file").addEventListener("change", (e) => chooseFile(e.target.files[0]));
  const dz = $("dropzone");
  dz.addEventListener("dragover", (e) => { e.preventDefault(); dz.classList.add("drag"); });
  dz.addEventListener("dragleave", () => dz.classList.remove("drag"));
  dz.addEventListener("drop", (e) => {
    e.preventDefault();
    dz.classList.remove("drag");
    chooseFile(e.dataTransfer.files[0]);
  });
  $("prompt").addEventListener("input", updateRunButton);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) run();
  });
  $("run").addEventListener("click", run);
  $("layer").addEventListener("input", (e) => { state.layer = Number(e.target.value); redraw(); });
  $("frame").addEventListener("input", (e) => { stopPlaying(); selectFrame(Number(e.target.value)); });
  $("frame-prev").addEventListener("click", () => { stopPlaying(); selectFrame(state.frame - 1); });
  $("frame-next").addEventListener("click", () => { stopPlaying(); selectFrame(state.frame + 1); });
  $("frame-play").addEventListener("click", togglePlay);
  // Arrow keys step through frames (left / right) and layers (up / down) on the picture.
  $("stage").addEventListener("keydown", (e) => {
    if (!state.result) return;
    const layers = currentGrid(state.result.media[state.frame]).masks.length;
    if (e.key === "ArrowLeft") { stopPlaying(); selectFrame(state.frame - 1); }
    else if (e.key === "ArrowRight") { stopPlaying(); selectFrame(state.frame + 1); }
    else if (e.key === "ArrowUp") { state.layer = Math.min(layers, state.layer + 1); redraw(); }
    else if (e.key === "ArrowDown") { state.layer = Math.max(0, state.layer - 1); redraw(); }
    else return;
    e.preventDefault();
  });
  let pending = 0;
  window.addEventListener("resize", () => {
    cancelAnimationFrame(pending);
    pending = requestAnimationFrame(redraw);
  });
  loadHealth();
  loadExamples().catch(() => setStatus("Could not load the examples.", "error"));
}

init();
