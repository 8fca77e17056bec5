// Drawing on <canvas>, by hand: line charts over time, the KV block pool as a grid of cells, and one
// request's lifecycle as a timeline. Each function redraws its canvas whole from the data it is given.

export const COLORS = {
  axis: "#8a8f98", grid: "#e4e6ea", text: "#3c4048",
  series: ["#2f6fdf", "#e8893a", "#9b59b6", "#2aa876"],
  blocks: ["#e4e6ea", "#9fd3b4", "#2f6fdf", "#1b8a5a"],  // free, cached and free, used, cached and used
};

/** The canvas's 2D context sized to its CSS box at the screen's pixel ratio, plus that box's size. */
function prepare(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 300;
  const height = canvas.clientHeight || 150;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, width, height };
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(value)));
  for (const m of [1, 2, 4, 5, 10]) if (m * step >= value) return m * step;  // quarters stay round
  return 10 * step;
}

function formatNumber(value) {
  if (value === 0) return "0";
  if (Math.abs(value) >= 100) return value.toFixed(0);
  if (Math.abs(value) >= 1) return value.toFixed(1).replace(/\.0$/, "");
  return value.toPrecision(2);
}

/**
 * A line chart over the last `spanSeconds`: series is [{label, values: [[unixSeconds, number|null], ...]}],
 * one color each; a null value breaks its line. The y axis starts at 0.
 */
export function drawLineChart(canvas, series, { now, spanSeconds = 120, emptyText = "no data yet" } = {}) {
  const { ctx, width, height } = prepare(canvas);
  const left = 40, right = 8, top = 16, bottom = 18;
  const plotW = width - left - right, plotH = height - top - bottom;
  const start = now - spanSeconds;
  const visible = series.map((s) => s.values.filter(([t, v]) => t >= start && v !== null && v !== undefined));
  const maxY = niceMax(Math.max(0, ...visible.flat().map(([, v]) => v)));
  ctx.strokeStyle = COLORS.grid;
  ctx.fillStyle = COLORS.text;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = top + plotH - (plotH * i) / 4;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + plotW, y); ctx.stroke();
    ctx.fillText(formatNumber((maxY * i) / 4), left - 4, y);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  ctx.fillText(`last ${spanSeconds} s`, left + plotW / 2, top + plotH + 4);
  const x = (t) => left + ((t - start) / spanSeconds) * plotW;
  const y = (v) => top + plotH - (v / maxY) * plotH;
  series.forEach((s, i) => {
    ctx.strokeStyle = COLORS.series[i % COLORS.series.length];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    for (const [t, v] of s.values) {
      if (t < start || v === null || v === undefined) { drawing = false; continue; }
      if (drawing) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
      drawing = true;
    }
    ctx.stroke();
  });
  ctx.lineWidth = 1;
  // The legend, top left, with each series' latest value.
  ctx.textAlign = "left";
  let legendX = left + 4;
  series.forEach((s, i) => {
    const last = visible[i].length ? visible[i][visible[i].length - 1][1] : null;
    const text = `${s.label} ${last === null ? "–" : formatNumber(last)}`;
    ctx.fillStyle = COLORS.series[i % COLORS.series.length];
    ctx.fillRect(legendX, 4, 8, 8);
    ctx.fillStyle = COLORS.text;
    ctx.fillText(text, legendX + 11, 2);
    legendX += ctx.measureText(text).width + 24;
  });
  if (!visible.some((v) => v.length)) {
    ctx.fillStyle = COLORS.axis;
    ctx.textBaseline = "middle";
    ctx.textAlign = "center";
    ctx.fillText(emptyText, left + plotW / 2, top + plotH / 2);
  }
}

/**
 * The KV block pool, one cell per block in block id order: states[i] is 0 free, 1 used, 2 cached and
 * free (evictable), 3 cached and used (the /debug/engine contract). Cells shrink to fit the canvas.
 */
export function drawBlockGrid(canvas, states) {
  const { ctx, width, height } = prepare(canvas);
  const n = states.length;
  if (!n) return;
  // The largest square cell that fits every block: 1024 blocks in 400 x 160 px are 7 px cells.
  let size = Math.max(1, Math.floor(Math.sqrt((width * height) / n)));
  while (size > 1 && Math.ceil(n / Math.floor(width / size)) * size > height) size -= 1;
  const columns = Math.max(1, Math.floor(width / size));
  const gap = size >= 6 ? 1 : 0;
  const fill = [COLORS.blocks[0], COLORS.blocks[2], COLORS.blocks[1], COLORS.blocks[3]];
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = fill[states[i]] || COLORS.axis;
    ctx.fillRect((i % columns) * size, Math.floor(i / columns) * size, size - gap, size - gap);
  }
}

/** Phases between events: what a request was doing from one event to the next. */
const PHASE_AFTER = {
  arrived: "waiting", queued: "waiting", scheduled: "prefill", prefix_hit: "prefill", prefill_chunk: "prefill",
  first_token: "decode", preempted: "preempted", swapped_in: "decode", resumed: "prefill", speculative: "decode",
};
const PHASE_COLORS = { waiting: "#c9ccd2", prefill: "#e8893a", decode: "#2f6fdf", preempted: "#d64545" };

/**
 * One request's lifecycle: colored bars for its phases (waiting, prefill, decode, preempted) on a time
 * axis from arrival to finish (or to `now` while it runs), and a tick per event.
 */
export function drawTimeline(canvas, detail, now) {
  const { ctx, width, height } = prepare(canvas);
  const events = detail.events || [];
  if (!events.length) return;
  const t0 = detail.arrival_time || events[0].time;
  const t1 = Math.max(detail.finish_time || now, events[events.length - 1].time, t0 + 1e-3);
  const left = 10, right = 10, barTop = 22, barH = 24;
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (width - left - right);
  let phase = "waiting";
  for (let i = 0; i < events.length; i++) {
    const next = i + 1 < events.length ? events[i + 1].time : t1;
    phase = PHASE_AFTER[events[i].event] || phase;
    if (events[i].event === "finished" || events[i].event === "aborted") break;
    ctx.fillStyle = PHASE_COLORS[phase];
    ctx.fillRect(x(events[i].time), barTop, Math.max(1, x(next) - x(events[i].time)), barH);
  }
  ctx.fillStyle = COLORS.text;
  ctx.strokeStyle = COLORS.text;
  ctx.textBaseline = "top";
  // Labels above or below the bar, wherever they do not overlap the previous one; an event with no
  // room for its label keeps its tick (the list under the canvas names every event).
  const rowEnds = [-Infinity, -Infinity];
  const rowY = [4, barTop + barH + 6];
  for (const e of events) {
    const ex = x(e.time);
    ctx.beginPath(); ctx.moveTo(ex, barTop - 4); ctx.lineTo(ex, barTop + barH + 4); ctx.stroke();
    const textW = ctx.measureText(e.event).width;
    const alignRight = ex + textW + 2 > width;
    const textStart = alignRight ? ex - textW - 2 : ex + 2;
    const row = rowEnds.findIndex((end) => end < textStart - 4);
    if (row < 0) continue;
    ctx.textAlign = "left";
    ctx.fillText(e.event, textStart, rowY[row]);
    rowEnds[row] = textStart + textW;
  }
  ctx.textAlign = "left";
  let legendX = left;
  for (const [name, color] of Object.entries(PHASE_COLORS)) {
    ctx.fillStyle = color;
    ctx.fillRect(legendX, height - 12, 10, 10);
    ctx.fillStyle = COLORS.text;
    ctx.fillText(name, legendX + 13, height - 13);
    legendX += ctx.measureText(name).width + 30;
  }
  ctx.textAlign = "right";
  ctx.fillText(`${((t1 - t0) * 1000).toFixed(0)} ms`, width - right, height - 13);
}
