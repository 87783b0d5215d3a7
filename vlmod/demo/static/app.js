// vlmod demo page: plain JavaScript, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  limits: null,
  source: null,        // {file: File} | {example: name}
  result: null,
  frame: 0,            // selected image / frame
  part: "language",    // "language" | "vision"
  view: 0,             // index into media[frame].views
  layer: 0,            // 0 = all MoD layers (counts), k = k-th MoD layer's mask
  images: [],          // decoded <img> per media item
};

// ----------------------------------------------------------------------------- colours

// A perceptual ramp (viridis stops) from "no MoD layer ran this token" to "every MoD layer did".
const RAMP = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

function ramp(t) {
  const x = Math.min(1, Math.max(0, t)) * (RAMP.length - 1);
  const i = Math.min(RAMP.length - 2, Math.floor(x));
  const f = x - i;
  return RAMP[i].map((c, k) => Math.round(c + f * (RAMP[i + 1][k] - c)));
}

const SKIPPED = "rgba(15, 23, 42, 0.78)";
const PROCESSED_EDGE = "rgba(250, 204, 21, 0.95)";

// ----------------------------------------------------------------------------- formatting

function pct(x, digits = 0) { return `${(100 * x).toFixed(digits)}%`; }

function flops(x) {
  const units = [["T", 1e12], ["G", 1e9], ["M", 1e6], ["k", 1e3]];
  for (const [u, v] of units) if (x >= v) return `${(x / v).toFixed(x / v >= 100 ? 0 : 1)} ${u}FLOPs`;
  return `${x.toFixed(0)} FLOPs`;
}

function seconds(s) { return s >= 1 ? `${s.toFixed(2)} s` : `${(1000 * s).toFixed(0)} ms`; }

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
  if (url) preview.append(el("img", { src: url, alt: "" }));
  else preview.append(el("span", { class: "play", "aria-hidden": "true" }));
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
    const mod = m.mod_layers.language || [];
    const parts = [`${m.architecture.replace("ForConditionalGeneration", "")}`,
      `${mod.length}/${m.language_layers} MoD layers`];
    if ((m.mod_layers.vision || []).length) parts.push("vision tower routed");
    if (m.dense) parts.push("dense baseline");
    $("model-info").textContent = parts.join(" · ");
    $("model-info").title = `${m.name}: ${(m.parameters / 1e6).toFixed(2)} M parameters`;
    $("dz-hint").textContent = `or click to choose a file · up to ${(h.limits.max_upload_bytes / 2 ** 20).toFixed(0)} MB`;
  } catch (err) {
    $("model-info").textContent = "server unreachable";
  }
}

// ----------------------------------------------------------------------------- run

async function run() {
  if (!state.source) return;
  const prompt = $("prompt").value.trim();
  if (!prompt) { setStatus("Type a prompt first.", "error"); return; }
  const form = new FormData();
  form.append("prompt", prompt);
  if (state.source.file) form.append("file", state.source.file);
  else form.append("example", state.source.example);
  document.body.dataset.state = "busy";
  updateRunButton();
  setStatus("Running the model…", "busy");
  const started = performance.now();
  try {
    const res = await fetch("/api/analyze", { method: "POST", body: form });
    let data;
    try { data = await res.json(); } catch { data = { error: `server answered ${res.status}` }; }
    if (!res.ok) throw new Error(data.error || `server answered ${res.status}`);
    await show(data);
    setStatus(`Done in ${seconds((performance.now() - started) / 1000)}.`, "ok");
    document.body.dataset.state = "done";
  } catch (err) {
    setStatus(err.message, "error");
    document.body.dataset.state = "error";
  } finally {
    updateRunButton();
  }
}

function loadImage(src) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error("could not display the picture"));
    img.src = src;
  });
}

async function show(result) {
  state.result = result;
  state.images = await Promise.all(result.media.map((m) => loadImage(m.src)));
  state.frame = 0;
  state.view = 0;
  state.layer = 0;
  if (state.part === "vision" && !result.media[0].vision) state.part = "language";
  $("empty").hidden = true;
  $("output").hidden = false;
  renderAnswer();
  renderToggles();
  renderStats();
  renderStrip();
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

function drawOverlay(canvas, img, grid, width) {
  const ratio = window.devicePixelRatio || 1;
  const height = Math.round(width * img.naturalHeight / img.naturalWidth);
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.imageSmoothingEnabled = true;
  ctx.imageSmoothingQuality = "high";
  ctx.drawImage(img, 0, 0, width, height);
  const cw = width / grid.cols;
  const ch = height / grid.rows;
  const nMod = grid.masks.length;
  const layer = state.layer;
  for (let r = 0; r < grid.rows; r++) {
    for (let c = 0; c < grid.cols; c++) {
      const i = r * grid.cols + c;
      const x = c * cw, y = r * ch;
      if (layer === 0) {
        // Tokens that ran every MoD layer stay clear; the fewer layers ran, the darker the cell.
        const t = nMod ? grid.counts[i] / nMod : 1;
        const [R, G, B] = ramp(t);
        ctx.fillStyle = `rgba(${R}, ${G}, ${B}, ${(0.3 + 0.45 * (1 - t)).toFixed(3)})`;
        ctx.fillRect(x, y, cw, ch);
      } else if (!grid.masks[layer - 1][i]) {
        ctx.fillStyle = SKIPPED;
        ctx.fillRect(x, y, cw, ch);
      } else {
        ctx.strokeStyle = PROCESSED_EDGE;
        ctx.lineWidth = Math.max(1, Math.min(2, Math.min(cw, ch) / 24));
        const inset = ctx.lineWidth / 2 + 0.5;
        ctx.strokeRect(x + inset, y + inset, cw - 2 * inset, ch - 2 * inset);
      }
    }
  }
  // Patch grid.
  ctx.strokeStyle = "rgba(255, 255, 255, 0.22)";
  ctx.lineWidth = 1;
  ctx.beginPath();
  for (let c = 1; c < grid.cols; c++) { ctx.moveTo(c * cw, 0); ctx.lineTo(c * cw, height); }
  for (let r = 1; r < grid.rows; r++) { ctx.moveTo(0, r * ch); ctx.lineTo(width, r * ch); }
  ctx.stroke();
  canvas.dataset.drawn = "1";
}

function stageWidth() {
  const wrap = document.querySelector(".stage-wrap");
  return Math.max(160, Math.min(560, wrap.clientWidth));
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
  drawOverlay($("stage"), state.images[state.frame], grid, stageWidth());
  renderLayerLabel(grid, layers);
  renderLegend(grid);
  for (const card of document.querySelectorAll(".frame-card")) {
    const k = Number(card.dataset.index);
    card.classList.toggle("selected", k === state.frame);
    const g = currentGrid(r.media[k]);
    drawOverlay(card.querySelector("canvas"), state.images[k], g, card.clientWidth - 2 || 120);
  }
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
  if (state.layer === 0) {
    label.innerHTML = "";
    label.append(el("b", { text: `All ${layers.mod.length} MoD layers` }),
      ` of ${layers.total} ${what} layers · colour = how many ran each token`);
    return;
  }
  const idx = layers.mod[state.layer - 1];
  const mask = grid.masks[state.layer - 1];
  const ran = mask.reduce((a, b) => a + b, 0);
  label.innerHTML = "";
  label.append(el("b", { text: `Layer ${idx}` }),
    ` of ${layers.total} · ${ran} of ${mask.length} tokens processed (${pct(ran / mask.length)}) in this grid`);
}

function renderLegend(grid) {
  const legend = $("legend");
  legend.textContent = "";
  if (state.layer === 0) {
    const n = grid.masks.length;
    const swatches = el("div", { class: "swatches" });
    for (let k = 0; k <= n; k++) {
      const [R, G, B] = ramp(n ? k / n : 1);
      swatches.append(el("span", { class: "swatch-step", style: `background: rgb(${R}, ${G}, ${B})`, text: String(k) }));
    }
    legend.append(el("span", { class: "legend-label", text: "MoD layers run" }), swatches);
  } else {
    legend.append(
      el("span", { class: "key" }, [el("span", { class: "swatch processed" }), "processed"]),
      el("span", { class: "key" }, [el("span", { class: "swatch skipped" }), "skipped (residual only)"]),
    );
  }
}

// ----------------------------------------------------------------------------- panels

function renderAnswer() {
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
  const lat = s.latency_s;
  if (s.dense) {
    const speed = s.dense.latency_s / lat.generate;
    box.append(stat("Latency", seconds(lat.generate),
      `generate · dense ${seconds(s.dense.latency_s)} · speedup ${speed.toFixed(2)}×`));
  } else {
    box.append(stat("Latency", seconds(lat.generate), `generate · preprocess ${seconds(lat.preprocess)}`));
  }
  if (s.vision_tower) {
    const v = s.vision_tower;
    box.append(stat("Vision tower", pct(v.skipped_fraction_all_layers),
      `of patch-token layer passes skipped (${v.tokens_skipped} of ${v.patch_tokens * r.layers.vision.total})`));
  }
  box.dataset.ready = "1";
}

function renderStrip() {
  const r = state.result;
  const wrap = $("strip-wrap");
  const strip = $("strip");
  strip.textContent = "";
  if (r.media.length < 2) { wrap.hidden = true; return; }
  wrap.hidden = false;
  $("strip-note").textContent = r.input === "frames"
    ? "· sent as one image each (image-only model)" : `· ${r.media.length} sampled frames`;
  r.media.forEach((item, k) => {
    const frac = item.stats.compute_fraction;
    const card = el("button", {
      type: "button", class: "frame-card", "data-index": String(k),
      onclick: () => { state.frame = k; renderToggles(); redraw(); },
    }, [
      el("canvas"),
      el("div", { class: "frame-meta" }, [
        el("span", { text: item.time_s == null ? `#${k + 1}` : `${item.time_s.toFixed(2)} s` }),
        el("span", { class: "frame-compute", text: pct(frac) }),
      ]),
      el("div", { class: "bar" }, [el("span", { style: `width: ${(100 * frac).toFixed(1)}%` })]),
    ]);
    card.title = `${item.stats.layer_passes} of ${item.stats.dense_layer_passes} token-layer passes run`;
    strip.append(card);
  });
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
  let pending = 0;
  window.addEventListener("resize", () => {
    cancelAnimationFrame(pending);
    pending = requestAnimationFrame(redraw);
  });
  loadHealth();
  loadExamples().catch(() => setStatus("Could not load the examples.", "error"));
}

init();
