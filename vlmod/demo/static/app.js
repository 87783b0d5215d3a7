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
  pixels: "model",     // "model": the pixels at the model's resolution | "sharp": the crop as uploaded
  images: [],          // decoded <img> per media item (the crop, sharp)
  modelImages: [],     // decoded <img> per media item (the crop at the model's resolution)
  original: null,      // <img> of the uploaded picture, for the crop outline
  generation: 0,       // bumps on every run, so a late answer never paints over a newer state
};

// ----------------------------------------------------------------------------- overlay style

// Readable on any picture: skipped tokens are dimmed (darker the more MoD layers skipped them),
// tokens that ran are outlined in Okabe-Ito sky blue on a dark halo (colour-blind safe, visible on
// bright and dark scenes alike). Brightness and outline carry the meaning, not hue alone.
const RUN_EDGE = "#56B4E9";
const HALO = "rgba(0, 0, 0, 0.85)";
const DIM_MAX = 0.68;    // opacity of the black veil over a token no MoD layer ran

function dimFor(count, n) { return n ? DIM_MAX * (1 - count / n) : 0; }

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

function chooseFile(file) {
  if (!file) return;
  const limit = state.limits ? state.limits.max_upload_bytes : Infinity;
  if (file.size > limit) {
    setStatus(`That file is ${(file.size / 2 ** 20).toFixed(1)} MB; the demo takes up to ${(limit / 2 ** 20).toFixed(0)} MB.`, "error");
    return;
  }
  state.source = { file };
  markExample(null);
  showPreview(file.type.startsWith("video") ? null : URL.createObjectURL(file), file.name,
    `${(file.size / 1024).toFixed(0)} KB · ${file.type || "unknown type"}`);
  setStatus("");
  updateRunButton();
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
        state.source = { example: ex.name };
        markExample(ex.name);
        $("prompt").value = ex.prompt;
        showPreview(ex.kind === "video" ? null : ex.url, ex.name.replace(/-/g, " "), `${ex.kind} · expected answer: ${ex.answer}`);
        setStatus("");
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
    const m = h.model;
    state.model = m;
    const mod = m.mod_layers.language || [];
    const parts = [`${m.architecture.replace("ForConditionalGeneration", "")}`,
      `${mod.length}/${m.language_layers} MoD layers`];
    if ((m.mod_layers.vision || []).length) parts.push("vision tower routed");
    if (m.dense) parts.push("dense baseline");
    $("model-info").textContent = parts.join(" · ");
    $("model-info").title = `${m.name}: ${(m.parameters / 1e6).toFixed(2)} M parameters`;
    $("dz-hint").textContent = `or click to choose a file · up to ${(h.limits.max_upload_bytes / 2 ** 20).toFixed(0)} MB`;
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
  setStatus(message, "error");
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
  const [images, modelImages] = await Promise.all([
    Promise.all(result.media.map((m) => loadImage(m.src))),
    Promise.all(result.media.map((m) => loadImage(m.model_src))),
  ]);
  state.original = null;
  if (source && source.file && result.kind === "image") {
    state.original = await loadImage(URL.createObjectURL(source.file)).catch(() => null);
  }
  state.result = result;
  state.images = images;
  state.modelImages = modelImages;
  state.frame = 0;
  state.view = 0;
  state.layer = 0;
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
  return state.pixels === "model" ? state.modelImages[k] : state.images[k];
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
    legend.append(el("span", { class: "key" }, [swatch(0, true), `ran at all ${n} MoD layers`]));
    for (let k = n - 1; k >= 1; k--) {
      legend.append(el("span", { class: "key" }, [swatch(dimFor(k, n), false), `ran at ${k} of ${n}`]));
    }
    legend.append(el("span", { class: "key" }, [swatch(dimFor(0, n), false), "skipped at every MoD layer"]));
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
  const o = item.original, c = item.crop, m = item.model_size;
  const cropped = c.width !== o.width || c.height !== o.height;
  const frame = state.result.kind === "video" ? "frame" : "picture";
  const parts = [];
  parts.push(cropped
    ? `The model saw the centre ${c.width}×${c.height} of your ${o.width}×${o.height} ${frame}`
    : `The model saw your whole ${o.width}×${o.height} ${frame}`);
  parts.push(`resized to ${m.width}×${m.height} px`);
  const cellW = m.width / grid.cols, cellH = m.height / grid.rows;
  const cell = Number.isInteger(cellW) && Number.isInteger(cellH) ? ` of ${cellW}×${cellH} px` : "";
  const which = grid.name === "tokens" ? "" : ` (${grid.name})`;
  note.textContent = `${parts.join(", ")}: one token per cell of this ${grid.cols}×${grid.rows} grid${cell}${which}.`;
  const thumb = $("crop-thumb");
  thumb.hidden = !(cropped && state.original);
  if (!thumb.hidden) {
    const img = state.original;
    const w = 96, h = Math.round(w * img.naturalHeight / img.naturalWidth);
    const ratio = window.devicePixelRatio || 1;
    thumb.width = w * ratio; thumb.height = h * ratio;
    thumb.style.width = `${w}px`; thumb.style.height = `${h}px`;
    const ctx = thumb.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.drawImage(img, 0, 0, w, h);
    const sx = w / o.width, sy = h / o.height;
    ctx.fillStyle = "rgba(0, 0, 0, 0.6)";
    ctx.fillRect(0, 0, w, h);
    ctx.drawImage(img, c.x, c.y, c.width, c.height, c.x * sx, c.y * sy, c.width * sx, c.height * sy);
    ctx.strokeStyle = RUN_EDGE;
    ctx.lineWidth = 2;
    ctx.strokeRect(c.x * sx + 1, c.y * sy + 1, c.width * sx - 2, c.height * sy - 2);
  }
}

// ----------------------------------------------------------------------------- frames

function renderFrameControls() {
  const r = state.result;
  const box = $("frame-controls");
  box.hidden = r.media.length < 2;
  const slider = $("frame");
  slider.max = String(r.media.length - 1);
  slider.value = "0";
}

function updateFrameControls() {
  const r = state.result;
  if (r.media.length < 2) return;
  const item = r.media[state.frame];
  $("frame").value = String(state.frame);
  $("frame-prev").disabled = state.frame === 0;
  $("frame-next").disabled = state.frame === r.media.length - 1;
  const [run, total] = tokensRun(currentGrid(item));
  const time = item.time_s == null ? "" : ` · ${item.time_s.toFixed(2)} s`;
  const what = state.layer === 0 ? "token-layer passes run" : "tokens run";
  $("frame-label").textContent = `Frame ${state.frame + 1} / ${r.media.length}${time} · ${run} of ${total} ${what}`;
}

function selectFrame(k) {
  const r = state.result;
  if (!r) return;
  const next = Math.max(0, Math.min(r.media.length - 1, k));
  if (next === state.frame) return;
  state.frame = next;
  renderToggles();
  redraw();
  const card = document.querySelector(`.frame-card[data-index="${next}"]`);
  if (card) card.scrollIntoView({ block: "nearest", inline: "nearest" });
}

function renderStrip() {
  const r = state.result;
  const wrap = $("strip-wrap");
  const strip = $("strip");
  strip.textContent = "";
  if (r.media.length < 2) { wrap.hidden = true; return; }
  wrap.hidden = false;
  $("strip-note").textContent = r.input === "frames"
    ? `· ${r.media.length} frames, sent as one image each (image-only model)` : `· ${r.media.length} sampled frames`;
  r.media.forEach((item, k) => {
    const card = el("button", {
      type: "button", class: "frame-card", "data-index": String(k),
      "aria-label": `Frame ${k + 1}`, onclick: () => selectFrame(k),
    }, [
      el("canvas"),
      el("div", { class: "frame-meta" }, [
        el("span", { text: item.time_s == null ? `#${k + 1}` : `${item.time_s.toFixed(2)} s` }),
        el("span", { class: "frame-count" }),
      ]),
      el("div", { class: "bar" }, [el("span")]),
    ]);
    card.title = `${item.stats.layer_passes} of ${item.stats.dense_layer_passes} token-layer passes run (all layers)`;
    strip.append(card);
  });
}

// ----------------------------------------------------------------------------- panels

function renderAnswer(source) {
  const r = state.result;
  $("answer").textContent = r.answer || "(empty answer)";
  const d = r.stats.dense;
  const box = $("dense-answer");
  if (d) {
    box.hidden = false;
    box.textContent = "";
    box.append(el("span", { class: "chip neutral", text: "dense" }), ` ${d.answer || "(empty)"} `,
      el("span", { class: `agree ${d.same_answer ? "yes" : "no"}`, text: d.same_answer ? "same answer" : "differs" }));
  } else {
    box.hidden = true;
  }
  // The embedded model knows synthetic shapes only: say so next to an answer about anything else.
  const about = state.model && state.model.about;
  const ood = $("ood-note");
  ood.hidden = !(about && about.embedded && source && source.file);
  if (!ood.hidden) {
    const m = state.model.input_size;
    ood.textContent = `The embedded model only knows synthetic ${m.width}×${m.height} px shapes; about your own `
      + "picture this answer is not meaningful. The token maps still show where it spends compute.";
  }
}

function renderLatency() {
  const box = $("latency");
  const t = state.result.stats.latency;
  box.textContent = "";
  // Only a fair measurement is shown: both models warm, untraced, interleaved, medians.
  box.hidden = !t;
  if (!t) return;
  const row = el("div", { class: "latency-row" }, [
    el("span", { class: "latency-label", text: "Latency" }),
    el("span", { class: "latency-value" }, [el("b", { text: seconds(t.mod_s) }), " MoD"]),
  ]);
  if (t.dense_s != null) {
    row.append(el("span", { class: "latency-value" }, [el("b", { text: seconds(t.dense_s) }), " dense"]));
    const faster = t.speedup >= 1;
    row.append(el("span", { class: `speedup ${faster ? "yes" : "no"}`, text: `${t.speedup.toFixed(2)}× ${faster ? "faster" : "(slower)"}` }));
  }
  box.append(row, el("div", { class: "latency-method", text: `How: ${t.method}.` }));
}

function segmented(container, options, active, onPick) {
  container.textContent = "";
  container.hidden = options.length < 2;
  options.forEach(([value, label]) => {
    container.append(el("button", {
      type: "button", class: value === active ? "active" : "", "aria-pressed": String(value === active),
      text: label, onclick: () => onPick(value),
    }));
  });
}

function renderToggles() {
  const r = state.result;
  const item = r.media[state.frame];
  const parts = [["language", "Language model"]];
  if (item.vision) parts.push(["vision", "Vision tower"]);
  segmented($("part-toggle"), parts, state.part, (p) => {
    state.part = p;
    state.layer = 0;
    renderToggles();
    redraw();
  });
  const views = state.part === "language" ? item.views.map((v, i) => [i, v.name]) : [];
  segmented($("view-toggle"), views, state.view, (v) => {
    state.view = v;
    renderToggles();
    redraw();
  });
  const m = item.model_size;
  segmented($("pixels-toggle"), [["model", `Model's pixels ${m.width}×${m.height}`], ["sharp", "Sharp"]], state.pixels, (p) => {
    state.pixels = p;
    renderToggles();
    redraw();
  });
}

function stat(label, value, detail) {
  return el("div", { class: "stat" }, [
    el("div", { class: "stat-label", text: label }),
    el("div", { class: "stat-value", text: value }),
    el("div", { class: "stat-detail", text: detail }),
  ]);
}

function renderStats() {
  const r = state.result;
  const s = r.stats;
  const nMod = r.layers.language.mod.length;
  const box = $("stats");
  box.textContent = "";
  const kind = r.input === "video" ? "video" : "image";
  box.append(stat("Vision tokens skipped", pct(s.skipped_fraction_mod_layers),
    `${s.tokens_skipped} of ${s.vision_tokens * nMod} ${kind}-token passes at ${nMod} MoD layers · ${s.text_tokens} text tokens always run`));
  box.append(stat("FLOPs saved", pct(s.flops.saved_fraction, 1),
    `${flops(s.flops.mod)} vs ${flops(s.flops.dense)} dense (prefill)`));
  if (s.vision_tower) {
    const v = s.vision_tower;
    box.append(stat("Vision tower", pct(v.skipped_fraction_all_layers),
      `of patch-token layer passes skipped (${v.tokens_skipped} of ${v.patch_tokens * r.layers.vision.total})`));
  }
  box.dataset.ready = "1";
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
  $("frame").addEventListener("input", (e) => selectFrame(Number(e.target.value)));
  $("frame-prev").addEventListener("click", () => selectFrame(state.frame - 1));
  $("frame-next").addEventListener("click", () => selectFrame(state.frame + 1));
  // Arrow keys step through frames (left / right) and layers (up / down) on the picture.
  $("stage").addEventListener("keydown", (e) => {
    if (!state.result) return;
    const layers = currentGrid(state.result.media[state.frame]).masks.length;
    if (e.key === "ArrowLeft") selectFrame(state.frame - 1);
    else if (e.key === "ArrowRight") selectFrame(state.frame + 1);
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
