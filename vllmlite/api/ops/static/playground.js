// The playground: a chat (or a raw completion) streamed token by token, with the sampling knobs,
// Stop (aborts the fetch; the server aborts the request when its client goes) and Regenerate, and
// per reply its time to first token and decode speed.

import { post, readEvents } from "./api.js";

const $ = (id) => document.getElementById(id);

/** The sampling fields from the settings panel; blank fields are left to the server's defaults. */
function samplingFields() {
  const fields = { max_tokens: parseInt($("max-tokens").value, 10) || 16 };
  const number = (id) => ($(id).value.trim() === "" ? null : Number($(id).value));
  if (number("temperature") !== null) fields.temperature = number("temperature");
  if (number("top-p") !== null) fields.top_p = number("top-p");
  if (number("seed") !== null) fields.seed = Math.trunc(number("seed"));
  const stop = $("stop").value.split(",").map((s) => s.replace(/\\n/g, "\n").trim()).filter((s) => s);
  if (stop.length) fields.stop = stop;
  return fields;
}

/** One message on screen: a role, its text, and a line of numbers under it. */
function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "message " + role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  box.append(label, content, meta);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return { box, content, meta };
}

function showError(reply, error) {
  reply.box.classList.add("error");
  reply.content.textContent += (reply.content.textContent ? "\n" : "") + "Error: " + error.message;
}

/** "TTFT 0.12 s · 35.1 tokens/s · 64 tokens · length" from one reply's timings (ms, performance.now()). */
export function describeTiming({ start, first, end, numTokens, finishReason, stopped }) {
  const parts = [];
  if (first !== null) parts.push(`TTFT ${((first - start) / 1000).toFixed(2)} s`);
  if (first !== null && numTokens > 1 && end > first) {
    parts.push(`${((numTokens - 1) / ((end - first) / 1000)).toFixed(1)} tokens/s`);
  }
  parts.push(`${numTokens} token${numTokens === 1 ? "" : "s"}`);
  if (stopped) parts.push("stopped");
  else if (finishReason) parts.push(finishReason);
  return parts.join(" · ");
}

export class Playground {
  constructor() {
    this.history = [];          // chat messages sent so far: {role, content}
    this.lastPrompt = null;     // the raw completion mode's last prompt, for Regenerate
    this.controller = null;     // the AbortController of the reply streaming now
    $("composer").addEventListener("submit", (event) => { event.preventDefault(); this.send(); });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); this.send(); }
    });
    $("stop-button").addEventListener("click", () => this.stop());
    $("regenerate").addEventListener("click", () => this.regenerate());
    $("clear").addEventListener("click", () => this.clear());
    $("mode").addEventListener("change", () => this.clear());
  }

  get isChat() {
    return $("mode").value === "chat";
  }

  send() {
    const text = $("prompt").value;
    if (this.controller || !text.trim()) return;
    $("prompt").value = "";
    addMessage(this.isChat ? "user" : "prompt", text);
    if (this.isChat) this.history.push({ role: "user", content: text });
    else this.lastPrompt = text;
    this.generate();
  }

  regenerate() {
    if (this.controller) return;
    const last = $("messages").lastElementChild;
    if (last && (last.classList.contains("assistant") || last.classList.contains("completion"))) last.remove();
    if (this.isChat && this.history.length && this.history[this.history.length - 1].role === "assistant") {
      this.history.pop();
    }
    this.generate();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  clear() {
    this.stop();
    this.history = [];
    this.lastPrompt = null;
    $("messages").replaceChildren();
    $("regenerate").disabled = true;
    $("system-label").hidden = !this.isChat;
  }

  /** The request for the current mode: chat messages (system prompt first) or the raw prompt. */
  request() {
    const body = { ...samplingFields(), stream: true, stream_options: { include_usage: true } };
    if (!this.isChat) return ["/v1/completions", { ...body, prompt: this.lastPrompt }];
    const system = $("system-prompt").value.trim();
    const messages = system ? [{ role: "system", content: system }, ...this.history] : [...this.history];
    return ["/v1/chat/completions", { ...body, messages }];
  }

  async generate() {
    if (this.isChat ? !this.history.length : this.lastPrompt === null) return;
    const [path, body] = this.request();
    const reply = addMessage(this.isChat ? "assistant" : "completion", "");
    const timing = { start: performance.now(), first: null, end: null, numTokens: 0, finishReason: null,
                     stopped: false };
    this.controller = new AbortController();
    this.setBusy(true);
    reply.box.classList.add("streaming");
    try {
      const response = await post(path, body, this.controller.signal);
      await readEvents(response, (chunk) => {
        if (chunk.usage) timing.numTokens = chunk.usage.completion_tokens;
        for (const choice of chunk.choices || []) {
          const text = this.isChat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
          if (text) {
            if (timing.first === null) timing.first = performance.now();
            if (!chunk.usage) timing.numTokens += 1;  // until the usage chunk says exactly
            reply.content.textContent += text;
          }
          if (choice.finish_reason) timing.finishReason = choice.finish_reason;
        }
        reply.meta.textContent = describeTiming({ ...timing, end: performance.now() });
      });
    } catch (error) {
      if (error.name === "AbortError") timing.stopped = true;
      else showError(reply, error);
    } finally {
      timing.end = performance.now();
      reply.meta.textContent = describeTiming(timing);
      reply.box.classList.remove("streaming");
      reply.box.dataset.done = timing.stopped ? "stopped" : "finished";
      if (this.isChat && !reply.box.classList.contains("error")) this.history.push({ role: "assistant", content: reply.content.textContent });
      this.controller = null;
      this.setBusy(false);
    }
  }

  setBusy(busy) {
    $("send").disabled = busy;
    $("stop-button").disabled = !busy;
    $("regenerate").disabled = busy;
  }
}
