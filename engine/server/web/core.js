// diffusion-engine web page, part 1 of 7: the API, the DOM helpers and errors shown with their code.
// Plain scripts (no framework, no build step), loaded in order by index.html; they share these globals.
"use strict";

const TOKEN_KEY = "diffusion-engine-token";
const POLL_MS = 500;
const $ = (selector, root = document) => root.querySelector(selector);
const state = { roots: null, trainInfo: null, trainAsked: 0, run: null, viewing: null, runStream: null, filesFor: null,
  job: null, dataset: null };

// -- the API ---------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

async function api(method, path, body) {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  // Every state-changing call is JSON, or a multipart upload (FormData: the browser sets its type):
  // a tokenless server refuses other content types (cross-site forms).
  const upload = body instanceof FormData;
  if (!upload && (body !== undefined || method !== "GET")) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, { method, headers, body: body === undefined || upload ? body : JSON.stringify(body) });
  } catch (error) {
    throw new ApiError(0, "unreachable", `the server did not answer (${error.message}); is it still running?`);
  }
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
  if (!response.ok) {
    const error = data && data.error ? data.error : { code: `http_${response.status}`, message: text.slice(0, 300) };
    if (response.status === 401) showSignIn(error.message);
    throw new ApiError(response.status, error.code, error.message);
  }
  return data;
}

/** A path under a prefix, each part encoded (a run's file, a dataset's image). */
const plural = (count, word) => `${count} ${word}${count === 1 ? "" : "s"}`;

/** A dataset's contents as words: "2 clips, 1 image" (clips named only where there are some). */
function mediaCount(dataset) {
  const clips = dataset.clips || 0;
  return [clips ? plural(clips, "clip") : null, dataset.images || !clips ? plural(dataset.images, "image") : null]
    .filter(Boolean).join(", ");
}

function encodedPath(prefix, relative) { return `${prefix}/${relative.split("/").map(encodeURIComponent).join("/")}`; }

/** A run's file as an object URL (the route needs the token, so a plain link cannot fetch it). */
async function fileUrl(runId, relative) {
  return blobUrl(encodedPath(`/v1/training/runs/${encodeURIComponent(runId)}/files`, relative));
}

/** What a GET of `path` answers, as an object URL (sent with the token). */
async function blobUrl(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const response = await fetch(path, { headers: token ? { Authorization: `Bearer ${token}` } : {} });
  if (!response.ok) {
    const data = await response.json().catch(() => null);
    const error = data && data.error ? data.error : { code: `http_${response.status}`, message: "" };
    throw new ApiError(response.status, error.code, error.message);
  }
  return URL.createObjectURL(await response.blob());
}

// -- small DOM helpers -----------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) if (child !== null && child !== undefined) node.append(child);
  return node;
}

function fmt(value) {
  if (value === null || value === undefined) return "-";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toPrecision(4);
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

function facts(list, entries) {
  list.replaceChildren(...entries.flatMap(([name, value]) => [el("dt", { text: name }), el("dd", { text: fmt(value) })]));
}

function table(headings, rows) {
  return el("div", { class: "table-wrap" }, el("table", {},
    el("thead", {}, el("tr", {}, headings.map((h) => el("th", { text: h })))),
    el("tbody", {}, rows.map((row) => el("tr", {}, row.map((cell) => el("td", { text: fmt(cell) })))))));
}

function resolvedTable(resolved) {
  return table(["decision", "value", "source", "reason"],
    Object.entries(resolved || {}).map(([name, r]) => [name, r.value, r.source, r.reason]));
}

/** Show an API error with its code in the box of `where` (a section, the sign-in form, or the page). */
async function showError(where, error) {
  const box = $(".error", where) || $("#global-error");
  const code = error instanceof ApiError ? error.code : "page_error";
  box.replaceChildren(el("code", { text: code }), " ", error.message || String(error));
  if (error instanceof ApiError && error.status === 409 && error.code !== "dataset_in_use" && error.code !== "image_exists") {
    try {
      const status = await api("GET", "/v1/images/status");
      const training = await api("GET", "/v1/training/status");
      const holder = status.job || (training.status === "running" || training.status === "pending" ? "training" : null);
      const run = training.run_id && holder === "training" ? ` (run ${training.run_id}, step ${training.step} of ${training.steps})` : "";
      box.append(el("div", { text: `The engine is held by: ${holder || "nothing now; try again"}${run}.` }));
    } catch (_) { /* the error above is what matters */ }
  }
  box.hidden = false;
}

function clearError(where) { const box = $(".error", where); if (box) box.hidden = true; }

async function guarded(where, work) {
  clearError(where);
  try { return await work(); } catch (error) { await showError(where, error); return undefined; }
}

// -- sign-in and tabs ------------------------------------------------------------------------------

function showSignIn(message) {
  document.querySelectorAll("[data-page]").forEach((page) => { page.hidden = true; });
  $("#tabs").hidden = true;
  $("#sign-out").hidden = true;
  const form = $("#sign-in");
  form.hidden = false;
  if (message && sessionStorage.getItem(TOKEN_KEY)) showError(form, new ApiError(401, "unauthorized", message));
  sessionStorage.removeItem(TOKEN_KEY);
}

async function start() {
  $("#loading").hidden = true;
  const required = $('meta[name="token-required"]').content === "yes";
  if (required && !sessionStorage.getItem(TOKEN_KEY)) { showSignIn(); return; }
  try {
    await api("GET", "/v1/families");
  } catch (error) {
    if (error.status !== 401) await showError(document, error);
    return;
  }
  $("#sign-in").hidden = true;
  $("#tabs").hidden = false;
  $("#sign-out").hidden = !sessionStorage.getItem(TOKEN_KEY);
  showTab(location.hash.slice(1) || "machine");
}

function showTab(name) {
  if (!$(`#${name}[data-page]`)) name = "machine";
  document.querySelectorAll("[data-page]").forEach((page) => { page.hidden = page.id !== name; });
  document.querySelectorAll("#tabs button").forEach((b) => b.classList.toggle("active", b.dataset.tab === name));
  history.replaceState(null, "", `#${name}`);
  ({ machine: loadMachine, generate: loadGenerate, video: loadVideo, kept: () => loadKept(0), datasets: loadDatasets,
    train: loadTrain, run: loadRun })[name]();
}
