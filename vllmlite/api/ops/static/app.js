// The page's entry point: the two views (the URL's #playground or #dashboard), the API key field,
// and the model name in the header. `?poll=<ms>` sets how often the dashboard polls (default 1000).

import { getApiKey, getJson, setApiKey } from "./api.js";
import { Dashboard } from "./dashboard.js";
import { Playground } from "./playground.js";

const $ = (id) => document.getElementById(id);
const pollMs = Math.max(100, parseInt(new URLSearchParams(location.search).get("poll"), 10) || 1000);
const dashboard = new Dashboard(pollMs);
new Playground();

function showView(name) {
  const view = name === "dashboard" ? "dashboard" : "playground";
  for (const tab of document.querySelectorAll(".tab")) tab.setAttribute("aria-selected", String(tab.dataset.view === view));
  $("playground").hidden = view !== "playground";
  $("dashboard").hidden = view !== "dashboard";
  if (view === "dashboard") dashboard.show(); else dashboard.hide();
}

/** The served model's name in the header, or why the server cannot be read. */
async function showModel() {
  try {
    const models = await getJson("/v1/models");
    $("server-status").textContent = models.data.map((m) => m.id).join(", ");
    $("server-status").classList.remove("bad");
  } catch (error) {
    $("server-status").textContent = error.message;
    $("server-status").classList.add("bad");
  }
}

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => { location.hash = tab.dataset.view; });
}
window.addEventListener("hashchange", () => showView(location.hash.slice(1)));

const keyField = $("api-key");
keyField.value = getApiKey();
keyField.addEventListener("change", () => { setApiKey(keyField.value.trim()); showModel(); });

showView(location.hash.slice(1));
showModel();
