// vlmod demo page: the panels beside the picture (answer, latency, toggles, stats cards).
// Loaded before app.js, whose helpers and state these functions use when called.
"use strict";

// ----------------------------------------------------------------------------- panels

function renderAnswer(source) {
  const r = state.result;
  const expected = r.expected;  // a bundled example asked its own question: each answer is marked
  $("answer").textContent = r.answer || "(empty answer)";
  if (expected) $("answer").append(" ", answerMark(expected.mod, expected.answer, "answer-mark"));
  const d = r.stats.dense;
  const box = $("dense-answer");
  if (d) {
    box.hidden = false;
    box.textContent = "";
    box.append(el("span", { class: "chip neutral", text: "dense" }), ` ${d.answer || "(empty)"} `);
    if (expected && expected.dense !== null) box.append(answerMark(expected.dense, expected.answer, "dense-mark"), " ");
    box.append(el("span", { class: `agree ${d.same_answer ? "yes" : "no"}`, text: d.same_answer ? "same answer" : "differs" }));
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

// ✓ correct / ✗ wrong against the example's expected answer, so a wrong answer reads as one.
function answerMark(correct, answer, id) {
  return el("span", {
    class: `mark ${correct ? "correct" : "wrong"}`, id,
    text: correct ? "✓ correct" : `✗ wrong (expected ${answer})`,
  });
}

function ratio(x) { return `${x.toFixed(2)}×`; }
// A dense / MoD ratio in words that match it: 1.14 is "1.14× faster", 0.88 is "1.14× slower".
function times(x) { return x >= 1 ? `${ratio(x)} faster` : `${ratio(1 / x)} slower`; }

// One latency row: MoD and dense with their ranges, the paired ratio with its interval, and the
// verdict only where the interval is clear of 1 (else "within noise") and the machine was quiet.
function latencyRow(label, note, f, unit, predictedFrom) {
  const range = (r) => (r[0] === r[1] ? "" : ` (${seconds(r[0])}–${seconds(r[1])})`);
  const row = el("div", { class: "latency-row" }, [
    el("span", { class: "latency-label" }, [label, el("span", { class: "latency-note", text: note })]),
    el("span", { class: "latency-value" }, [el("b", { text: seconds(f.mod_s) + unit }), ` MoD${range(f.mod_range_s)}`]),
  ]);
  if (f.dense_s != null) {
    row.append(el("span", { class: "latency-value" }, [el("b", { text: seconds(f.dense_s) + unit }), ` dense${range(f.dense_range_s)}`]));
    const [lo, hi] = f.interval;
    // Slower reads as MoD's time over dense's, so its interval turns round with it.
    const interval = lo === hi ? "" : f.speedup < 1
      ? `, ${ratio(1 / hi)}–${ratio(1 / lo)} over the runs` : `, ${ratio(lo)}–${ratio(hi)} over the runs`;
    // Without a verdict the bare ratio (dense / MoD) and its interval, no "faster" or "slower".
    const bare = lo === hi ? "" : `, ${ratio(lo)}–${ratio(hi)} over the runs`;
    const words = {
      faster: `${times(f.speedup)}${interval}`,
      slower: `${times(f.speedup)}${interval}`,
      "within noise": `within noise (${ratio(f.speedup)}${bare})`,
      contended: `${ratio(f.speedup)}${bare}: contended, no verdict`,
      "one run": `${ratio(f.speedup)} from one run: no spread, no verdict`,
    };
    const kind = { faster: "yes", slower: "no" }[f.verdict] || "neutral";
    row.append(el("span", { class: `speedup ${kind}`, "data-verdict": f.verdict, text: words[f.verdict] }));
    if (f.predicted_speedup != null) {
      row.append(el("span", { class: "latency-predicted", text: `predicted ${times(f.predicted_speedup)} from ${predictedFrom}` }));
    }
  }
  return row;
}

function renderLatency() {
  const box = $("latency");
  const t = state.result.stats.latency;
  box.textContent = "";
  // Only a fair measurement is shown: both models warm, untraced, interleaved, others held off.
  box.hidden = !t;
  if (!t) return;
  box.append(el("div", { class: "latency-title", text: "Latency" }));
  box.append(latencyRow("Time to first token", "prefill: what MoD cuts", t.prefill, "",
    "the whole prefill's FLOPs, vision tower included"));
  if (t.decode) box.append(latencyRow("Decode", "per new token", t.decode, " /token", "bytes read"));
  if (t.contended) {
    box.append(el("div", { class: "latency-contended", role: "note",
      text: `Contended: ${t.contention.reason}. Other work shared the CPU, so these figures carry no verdict; run again on a quiet machine.` }));
  }
  box.append(el("div", { class: "latency-purpose", text: t.purpose }));
  box.append(el("div", { class: "latency-method", text: `How: ${t.method}.` }));
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
  const grid = currentGrid(item);
  const m = (state.part === "language" && grid.model_size) || item.model_size;
  segmented($("pixels-toggle"), [["sharp", "Sharp"], ["model", `Model's pixels ${m.width}×${m.height}`]], state.pixels, (p) => {
    state.pixels = p;
    state.pixelsChosen = true;
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

// The router's capacity of the MoD layers of one part: one number when all are alike.
function capacityText(caps) {
  const values = [...new Set(Object.values(caps || {}).map((c) => pct(c, c * 100 % 1 ? 1 : 0)))];
  if (!values.length) return "";
  return values.length === 1 ? `capacity ${values[0]}` : `capacities ${values.join(", ")}`;
}

function renderStats() {
  const r = state.result;
  const s = r.stats;
  const nMod = r.layers.language.mod.length;
  const box = $("stats");
  box.textContent = "";
  const kind = r.input === "video" ? "video" : "image";
  const f = s.flops;
  const towerRouted = r.layers.vision.mod.length > 0;
  box.append(stat("Language-model prefill FLOPs", `${pct(f.language_saved_fraction, 1)} saved`,
    `${flops(f.mod_language)} vs ${flops(f.dense_language)} dense: what MoD cuts`));
  box.append(stat("Total prefill FLOPs", `${pct(f.saved_fraction, 1)} saved`,
    `${flops(f.mod)} vs ${flops(f.dense)} dense, with the vision tower (${flops(f.mod_vision)}`
    + `${towerRouted ? ", partly routed" : ", which MoD does not touch here"})`));
  const caps = capacityText((s.capacity || {}).language);
  box.append(stat("Router budget", `${pct(s.skipped_fraction_mod_layers)} skipped`,
    `of ${kind} tokens at each of ${nMod} MoD layers, set by the router's ${caps} (the share it keeps): `
    + "a fixed budget, the same for every input, not a measurement; the router picks which tokens · "
    + `${s.tokens_skipped} of ${s.vision_tokens * nMod} token passes · ${s.text_tokens} text tokens always run`));
  if (s.vision_tower) {
    const v = s.vision_tower;
    const vcaps = capacityText((s.capacity || {}).vision);
    box.append(stat("Vision-tower budget", `${pct(v.skipped_fraction_all_layers)} skipped`,
      `of patch-token layer passes (${v.tokens_skipped} of ${v.patch_tokens * r.layers.vision.total}), `
      + `fixed by the router's ${vcaps}`));
  }
  box.dataset.ready = "1";
}
