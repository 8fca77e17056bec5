// The live dashboard: polls /v1/stats (always on) and, when the server runs with
// --enable-debug-endpoints, /debug/engine (per-block states) and /debug/requests (the recent requests
// table; a click fetches /debug/requests/{id} and draws its timeline). Polls only while visible.
// Behind the Ray ingress (--num-replicas) the same routes answer for every replica: /debug/engine
// holds one payload per replica and each request names its replica.

import { ApiError, getJson } from "./api.js";
import { drawBlockGrid, drawLineChart, drawTimeline } from "./charts.js";

const $ = (id) => document.getElementById(id);
const HISTORY_SECONDS = 120;
const DEBUG_RETRY_MS = 15000;  // how often to look again for debug endpoints that answered 404
const DEBUG_HINT = "Per-block KV states, the recent requests and their timelines need the debug endpoints: " +
  "start the server with --enable-debug-endpoints (or VLLMLITE_ENABLE_DEBUG_ENDPOINTS=true). " +
  "The numbers and charts below come from /v1/stats, which is always on.";

const seconds = (value) => (value === null || value === undefined ? "–" : `${value.toFixed(2)} s`);
const percent = (value) => `${(100 * value).toFixed(1)} %`;

export class Dashboard {
  constructor(pollMs) {
    this.pollMs = pollMs;
    this.timer = null;
    this.samples = [];            // [{time, stats, genRate, promptRate}], oldest first
    this.debugAvailable = null;   // unknown until the first answer
    this.debugCheckedAt = 0;
    this.selectedId = null;
  }

  show() {
    if (this.timer === null) {
      this.poll();
      this.timer = setInterval(() => this.poll(), this.pollMs);
    }
  }

  hide() {
    clearInterval(this.timer);
    this.timer = null;
  }

  async poll() {
    if (this.busy) return;  // a slow server: never stack polls
    this.busy = true;
    try {
      this.addSample(await getJson("/v1/stats"));
      this.notice(null);
      await this.pollDebug();
    } catch (error) {
      this.notice(error instanceof ApiError ? error.message : `cannot reach the server: ${error.message}`);
    } finally {
      this.busy = false;
      this.draw();
    }
  }

  /** /debug/engine and /debug/requests, unless they answered 404 less than DEBUG_RETRY_MS ago. */
  async pollDebug() {
    if (this.debugAvailable === false && Date.now() - this.debugCheckedAt < DEBUG_RETRY_MS) return;
    try {
      const [engine, requests] = await Promise.all([getJson("/debug/engine"), getJson("/debug/requests")]);
      this.debugAvailable = true;
      this.engine = engine;
      this.renderRequests(requests.requests);
      // A running request's timeline grows; one gone from the server's ring stays as last drawn.
      if (this.selectedId !== null) this.showTimeline(this.selectedId).catch(() => {});
    } catch (error) {
      if (!(error instanceof ApiError && error.status === 404)) throw error;
      this.debugAvailable = false;
      this.debugCheckedAt = Date.now();
      this.engine = null;
      this.renderNoRequests();
    }
    $("debug-notice").hidden = this.debugAvailable !== false;
    $("debug-notice").textContent = DEBUG_HINT;
  }

  /** Keep the last HISTORY_SECONDS of stats; token rates are differences between two polls. */
  addSample(stats) {
    const previous = this.samples[this.samples.length - 1];
    let genRate = null, promptRate = null;
    if (previous && stats.time > previous.time) {
      const dt = stats.time - previous.time;
      genRate = Math.max(0, stats.tokens.generation - previous.stats.tokens.generation) / dt;
      promptRate = Math.max(0, stats.tokens.prompt - previous.stats.tokens.prompt) / dt;
    }
    this.samples.push({ time: stats.time, stats, genRate, promptRate });
    while (this.samples.length && this.samples[0].time < stats.time - HISTORY_SECONDS) this.samples.shift();
  }

  notice(message) {
    $("dashboard-status").textContent = message || "";
    $("dashboard-status").hidden = !message;
  }

  draw() {
    const latest = this.samples[this.samples.length - 1];
    if (!latest) return;
    const s = latest.stats, now = latest.time;
    // The time axis grows with the history, from 30 s to HISTORY_SECONDS, so the lines fill the chart.
    const span = Math.min(HISTORY_SECONDS, Math.max(30, Math.ceil(now - this.samples[0].time)));
    const series = (label, pick) => ({ label, values: this.samples.map((p) => [p.time, pick(p)]) });
    drawLineChart($("chart-requests"), [series("running", (p) => p.stats.num_running),
      series("waiting", (p) => p.stats.num_waiting), series("swapped", (p) => p.stats.num_swapped)],
      { now, spanSeconds: span });
    drawLineChart($("chart-throughput"), [series("generated", (p) => p.genRate),
      series("prompt", (p) => p.promptRate)], { now, spanSeconds: span });
    drawLineChart($("chart-ttft"), [series("p50", (p) => p.stats.latency.ttft_p50),
      series("p90", (p) => p.stats.latency.ttft_p90)],
      { now, spanSeconds: span, emptyText: "no finished request yet" });
    this.drawBlocks(s.kv_blocks);
    this.renderCards(latest);
  }

  /** The pool from /debug/engine's per-block states (behind the Ray ingress, each replica's pool in
   * turn, replica 0's first: /v1/stats' counts are their sums); without them, from the counts (used
   * first, no cache). */
  drawBlocks(kv) {
    const engines = this.engine ? this.engine.replicas || [this.engine] : [];
    const states = engines.length ? engines.flatMap((e) => e.blocks)
      : Array.from({ length: kv.total }, (_, i) => (i < kv.used ? 1 : 0));
    drawBlockGrid($("block-grid"), states);
    let detail = "";
    if (!engines.length) detail = " (from counts: start with --enable-debug-endpoints for each block's state)";
    else if (this.engine.replicas) detail = ` (replicas ${engines.map((e) => e.replica).join(", ")}, one pool after another)`;
    $("blocks-caption").textContent = `KV blocks: ${kv.used} used, ${kv.cached} cached, ${kv.free} free ` +
      `of ${kv.total}${detail}` + (engines.length ? `. Prefill chunking: ${chunkingText(engines[0].chunking)}` : "");
  }

  renderCards({ stats: s, genRate }) {
    const cards = [
      ["running", "Running", s.num_running], ["waiting", "Waiting", s.num_waiting],
      ["swapped", "Swapped", s.num_swapped], ["kv-usage", "KV cache used", percent(s.kv_cache_usage)],
      ["hit-rate", "Prefix-cache hit rate", percent(s.prefix_cache.hit_rate)],
      ["throughput", "Generated tokens/s", genRate === null ? "–" : genRate.toFixed(1)],
      ["generated", "Tokens generated", s.tokens.generation], ["ttft", "TTFT p50", seconds(s.latency.ttft_p50)],
      ["preemptions", "Preemptions", s.num_preemptions],
      ["finished", "Finished / aborted", `${s.requests.finished} / ${s.requests.aborted}`],
    ];
    $("cards").replaceChildren(...cards.map(([id, label, value]) => {
      const card = document.createElement("div");
      card.className = "card";
      card.id = "card-" + id;
      card.innerHTML = '<div class="label"></div><div class="value"></div>';
      card.firstChild.textContent = label;
      card.lastChild.textContent = String(value);
      return card;
    }));
  }

  renderRequests(requests) {
    const cell = (text) => { const td = document.createElement("td"); td.textContent = text; return td; };
    $("requests").tBodies[0].replaceChildren(...requests.map((r) => {
      const row = document.createElement("tr");
      row.dataset.requestId = r.request_id;
      row.classList.toggle("selected", r.request_id === this.selectedId);
      const id = r.replica === undefined ? r.request_id : `${r.request_id} (replica ${r.replica})`;
      row.append(cell(id), cell(r.state), cell(r.num_prompt_tokens), cell(r.num_output_tokens),
        cell(r.num_cached_tokens), cell(seconds(r.ttft)), cell(seconds(r.e2e)), cell(r.num_preemptions),
        cell(r.finish_reason || ""));
      row.addEventListener("click", () => this.select(r.request_id));
      return row;
    }));
  }

  renderNoRequests() {
    const row = document.createElement("tr");
    row.className = "placeholder";
    row.innerHTML = '<td colspan="9">No requests to show: this needs --enable-debug-endpoints.</td>';
    $("requests").tBodies[0].replaceChildren(row);
  }

  async select(requestId) {
    this.selectedId = requestId;
    for (const row of $("requests").tBodies[0].rows) row.classList.toggle("selected", row.dataset.requestId === requestId);
    try {
      await this.showTimeline(requestId);
    } catch (error) {
      this.notice(error.message);
    }
  }

  async showTimeline(requestId) {
    const detail = await getJson("/debug/requests/" + encodeURIComponent(requestId));
    $("timeline").hidden = false;
    $("timeline-title").textContent = `Timeline of ${requestId} (${detail.state})`;
    drawTimeline($("timeline-canvas"), detail, Date.now() / 1000);
    const t0 = detail.arrival_time || (detail.events[0] && detail.events[0].time) || 0;
    $("timeline-events").replaceChildren(...detail.events.map((e) => {
      const item = document.createElement("li");
      const extra = Object.entries(e).filter(([k]) => k !== "time" && k !== "event").map(([k, v]) => `${k}=${v}`);
      item.textContent = `+${((e.time - t0) * 1000).toFixed(1)} ms  ${e.event}${extra.length ? "  " + extra.join(" ") : ""}`;
      item.dataset.event = e.event;
      return item;
    }));
  }
}

/** /debug/engine's chunking decision in a line: "adaptive, 48 prompt tokens a step (by time 48, by
 * memory 2048; step 91 ms predicted, 88 measured, target 100 ms)". */
function chunkingText(c) {
  if (!c) return "–";
  const ms = (v) => (v === null || v === undefined ? "–" : `${v.toFixed(0)} ms`);
  if (c.policy === "fixed") return `fixed, up to ${c.prefill_budget} prompt tokens a step`;
  return `adaptive, ${c.prefill_budget} prompt tokens a step (by time ${c.budget_by_time}, by memory ` +
    `${c.budget_by_memory}; step ${ms(c.predicted_step_ms)} predicted, ${ms(c.last_step_ms)} measured, ` +
    `target ${ms(c.target_tpot_ms)})`;
}
