// Talking to the server: the API key (kept in sessionStorage, sent as `Authorization: Bearer`),
// JSON requests with OpenAI-shaped errors, and server-sent events read from a fetch body.

const KEY_STORAGE = "vllmlite.apiKey";

export function getApiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

/** An error the server answered: `status` and the message from its {"error": {...}} body. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(json) {
  const h = json ? { "Content-Type": "application/json" } : {};
  const key = getApiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorFrom(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: keep the status line */ }
  if (response.status === 401) message = "the server wants an API key: type it in the field at the top (" + message + ")";
  return new ApiError(response.status, message);
}

/** GET `path` as JSON; throws ApiError for a non-2xx answer. */
export async function getJson(path) {
  const response = await fetch(path, { headers: headers(false) });
  if (!response.ok) throw await errorFrom(response);
  return response.json();
}

/** POST `body` to `path` and return the response once its headers are in (the body may stream). */
export async function post(path, body, signal) {
  const response = await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
  if (!response.ok) throw await errorFrom(response);
  return response;
}

/**
 * Read a text/event-stream body and call onData(parsed JSON) for each `data:` event until
 * `data: [DONE]`. Comment lines (the server's keep-alive pings) are skipped. An event carrying
 * {"error": ...} (a failure after the stream started) throws ApiError.
 */
export async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const parsed = JSON.parse(data);
      if (parsed.error) throw new ApiError(parsed.error.code || 500, parsed.error.message);
      onData(parsed);
    }
  }
}
