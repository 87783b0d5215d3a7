// vlmod demo page: the frames of a clip (slider, play, the strip that follows the selected frame).
// Loaded before app.js, whose helpers and state these functions use when called.
"use strict";

// ----------------------------------------------------------------------------- frames

function renderFrameControls() {
  const r = state.result;
  const box = $("frame-controls");
  box.hidden = r.media.length < 2;
  $("frame-heading").hidden = r.media.length < 2;
  const slider = $("frame");
  slider.max = String(r.media.length - 1);
  slider.value = "0";
  stopPlaying();
}

// Play a clip: step through its frames at the pace they were sampled (timestamps), at least 4 a
// second so 8 frames of a long clip do not crawl; from the start again when at the end.
function playDelay() {
  const t = state.result.media.map((m) => m.time_s).filter((x) => x != null);
  const step = t.length > 1 ? (t[t.length - 1] - t[0]) / (t.length - 1) : 0.25;
  return Math.round(1000 * Math.min(0.5, Math.max(0.1, step)));
}

function togglePlay() {
  if (state.playing) { stopPlaying(); return; }
  const r = state.result;
  if (!r || r.media.length < 2) return;
  if (state.frame === r.media.length - 1) selectFrame(0);
  state.playing = setInterval(() => {
    if (!state.result || state.frame >= state.result.media.length - 1) { stopPlaying(); return; }
    selectFrame(state.frame + 1);
  }, playDelay());
  updatePlayButton();
}

function stopPlaying() {
  if (state.playing) clearInterval(state.playing);
  state.playing = 0;
  updatePlayButton();
}

function updatePlayButton() {
  const b = $("frame-play");
  b.textContent = state.playing ? "\u275A\u275A Pause" : "\u25B6 Play";
  b.setAttribute("aria-label", state.playing ? "Pause" : "Play the frames");
  b.setAttribute("aria-pressed", String(Boolean(state.playing)));
}

// Scroll the strip (only the strip, never the page) so the selected frame's card is in view: to
// the card's start, which is also where the strip snaps, so snapping cannot cut the card off.
function scrollStripTo(k) {
  const strip = $("strip");
  const card = strip.querySelector(`.frame-card[data-index="${k}"]`);
  if (!card || strip.parentElement.hidden) return;
  const left = card.offsetLeft;  // the strip is the cards' offset parent (position: relative)
  const right = left + card.offsetWidth;
  if (left < strip.scrollLeft || right > strip.scrollLeft + strip.clientWidth) strip.scrollLeft = left;
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
  scrollStripTo(next);
}

function renderStrip() {
  const r = state.result;
  const wrap = $("strip-wrap");
  const strip = $("strip");
  strip.textContent = "";
  strip.scrollLeft = 0;
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
