// diffusion-engine web page, part 2 of 7: the Machine and Generate pages.
"use strict";

// -- Machine ---------------------------------------------------------------------------------------

async function loadMachine() {
  const page = $("#machine");
  await guarded(page, async () => {
    const [info, training, plans] = await Promise.all(
      [api("GET", "/v1/images/info"), api("GET", "/v1/training/info"), api("GET", "/v1/images/plans")]);
    const hw = info.hardware;
    facts($("#hardware"), [["device", `${hw.device_name} (${hw.vendor})`], ["memory", `${fmt(hw.total_memory_gb)} GB, ${fmt(hw.free_memory_gb)} GB free`],
      ["CUDA", hw.cuda], ["native bf16", hw.native_bf16], ["fp8", hw.fp8], ["CPU cores", hw.cpu_count], ["torch", hw.torch_version]]);
    $("#families").replaceChildren(...Object.keys(info.families).map((name) => familyCard(info.families[name], training[name], plans[name])));
  });
}

function familyCard(images, training, plan) {
  const denied = Object.entries(images.denied || {});
  const modes = [
    ...training.precision_modes.map((mode) => el("div", { class: "mode" }, el("strong", { text: mode }),
      el("span", { class: "ok", text: mode === training.recommended_precision ? "offered (recommended)" : "offered" }))),
    ...Object.entries(training.denied_modes || {}).map(([mode, reason]) => el("div", { class: "mode denied" },
      el("strong", { text: mode }), el("span", { class: "reason", text: `not offered: ${reason}` }))),
  ];
  return el("div", { class: "card family", "data-family": images.family },
    el("h2", {}, images.label, el("span", { class: `tag ${training.trainable ? "ok" : "muted"}`,
      text: training.trainable ? "trains here" : "does not train here" })),
    el("p", { class: "muted", text: `checkpoints: ${images.checkpoints.join(", ")}` }),
    el("h3", { text: "Inference plan" }),
    el("div", { class: "plan" }, plan.error
      ? el("p", { class: "bad reason" }, el("code", { text: plan.error.code }), ` cannot run here: ${plan.error.message}`)
      : [el("p", { text: `device ${plan.device}, resident ${fmt(plan.estimate.resident_gb)} GB, peak ${fmt(plan.estimate.peak_gb)} GB` }),
        resolvedTable(plan.resolved)]),
    el("h3", { text: "Weights per scheme" }),
    table(["scheme", "resident GB", "note"], [
      ...Object.entries(images.resident_gb).map(([scheme, gb]) => [scheme, gb, images.denied[scheme] ? "denied" : ""]),
      ...denied.filter(([scheme]) => !(scheme in images.resident_gb)).map(([scheme, why]) => [scheme, "-", why]),
    ]),
    denied.length ? el("ul", {}, denied.map(([scheme, why]) => el("li", { class: "muted", text: `${scheme} denied: ${why}` }))) : null,
    el("h3", { text: "Training" }),
    el("p", { class: "reason", text: training.vram_note }),
    el("div", { class: "modes" }, modes));
}

// -- roots (models, datasets, LoRAs) ----------------------------------------------------------------

async function roots(refresh = false) {
  if (!state.roots || refresh) state.roots = await api("GET", "/v1/roots");
  return state.roots;
}

function fillSelect(select, entries, label) {
  const current = select.value;
  select.replaceChildren(...entries.map((e) => el("option", { value: e.path, text: label(e) })));
  if (!entries.length) select.append(el("option", { value: "", text: "nothing under the configured roots" }));
  if (entries.some((e) => e.path === current)) select.value = current;
}

// -- Generate --------------------------------------------------------------------------------------

async function loadGenerate() {
  const page = $("#generate");
  await guarded(page, async () => {
    const found = await roots(true);
    fillSelect($("#gen-model"), found.models, (m) => `${m.name} (${m.family || "unknown family"})`);
    const box = $("#gen-loras");
    if (found.loras.length) {
      box.replaceChildren(el("legend", { text: "LoRAs" }), ...found.loras.map((lora) => el("div", { class: "row lora" },
        el("label", { class: "mode" }, el("input", { type: "checkbox", value: lora.path }), lora.name),
        el("label", {}, "scale", el("input", { type: "number", step: "0.05", min: "-8", max: "8", value: "1" })))));
    }
    await showLoaded();
  });
}

function chosenLoras() {
  return [...document.querySelectorAll("#gen-loras .lora")].filter((row) => $("input[type=checkbox]", row).checked)
    .map((row) => ({ path: $("input[type=checkbox]", row).value, scale: Number($("input[type=number]", row).value) }));
}

async function showLoaded() {
  const status = await api("GET", "/v1/images/status");
  const pipeline = status.pipeline;
  $("#gen-loaded").textContent = pipeline ? `loaded: ${pipeline.model.location || pipeline.model.family}` : "nothing loaded";
  return status;
}

function progress(bar, done, total, label) {
  bar.hidden = false;
  bar.classList.toggle("indeterminate", !total);
  $("div", bar).style.width = total ? `${Math.round((100 * done) / total)}%` : "";
  $("span", bar).textContent = label;
}

/** Poll the engine's status while `work` runs, so the bar moves during load and denoise. */
async function whilePolling(work, onStatus) {
  let done = false;
  const poll = async () => {
    while (!done) {
      try { onStatus(await api("GET", "/v1/images/status")); } catch (_) { /* the work's own error is shown */ }
      await new Promise((resolve) => setTimeout(resolve, POLL_MS / 2));
    }
  };
  const poller = poll();
  try { return await work(); } finally { done = true; await poller; }
}

/** A URL for an event stream: EventSource cannot send headers, so these routes take the token as ?token=. */
function streamUrl(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? `${path}?token=${encodeURIComponent(token)}` : path;
}

/** Follow a generate job over its event stream until it ends; its final JSON (images included).
 *  Should the stream break, the job is polled instead. */
function followJob(job, onProgress, kind = "images") {
  // A video job streams at /v1/videos/{id}/events; polled, its job record is the image queue's own.
  const events = kind === "videos" ? `/v1/videos/${encodeURIComponent(job.id)}/events`
    : `/v1/images/jobs/${encodeURIComponent(job.id)}/events`;
  return new Promise((resolve, reject) => {
    const stream = new EventSource(streamUrl(events));
    const poll = async () => {
      try {
        let current = await api("GET", `/v1/images/jobs/${encodeURIComponent(job.id)}`);
        while (["queued", "running"].includes(current.state)) {
          onProgress(current.state === "queued" ? "queued" : "step", current);
          await new Promise((r) => setTimeout(r, POLL_MS));
          current = await api("GET", `/v1/images/jobs/${encodeURIComponent(job.id)}`);
        }
        resolve(current);
      } catch (error) { reject(error); }
    };
    for (const name of ["queued", "running", "step"]) {
      stream.addEventListener(name, (event) => onProgress(name, JSON.parse(event.data)));
    }
    for (const name of ["done", "failed", "cancelled"]) {
      stream.addEventListener(name, (event) => { stream.close(); resolve(JSON.parse(event.data)); });
    }
    stream.onerror = () => { stream.close(); poll(); };
  });
}

async function planModel() {
  const page = $("#generate");
  await guarded(page, async () => {
    const body = { model: $("#gen-model").value };
    if ($("#gen-steps").value !== "") body.steps = Number($("#gen-steps").value);
    const plan = await api("POST", "/v1/images/plan", body);
    $("#gen-plan-out").replaceChildren(el("h3", { text: `Plan: ${plan.family} / ${plan.checkpoint} on ${plan.device}` }),
      el("p", { text: `resident ${fmt(plan.estimate.resident_gb)} GB, peak ${fmt(plan.estimate.peak_gb)} GB` }), resolvedTable(plan.resolved));
  });
}

async function loadModel() {
  const bar = $("#gen-progress");
  const loaded = await whilePolling(
    () => api("POST", "/v1/images/load", { model: $("#gen-model").value, loras: chosenLoras() }),
    (status) => progress(bar, 0, 0, `loading: ${status.load_phase}`));
  progress(bar, 1, 1, "loaded");
  await showLoaded();
  return loaded;
}

async function generate(event) {
  event.preventDefault();
  const page = $("#generate");
  const go = $("#gen-go");
  go.disabled = true;
  $("#gen-cancel").hidden = false;
  await guarded(page, async () => {
    const status = await api("GET", "/v1/images/status");
    if (!status.pipeline || status.pipeline.model.location !== $("#gen-model").value) await loadModel();
    const body = { prompt: $("#gen-prompt").value, seed: Number($("#gen-seed").value), count: Number($("#gen-count").value) };
    for (const name of ["width", "height", "steps"]) {  // empty: the model's default
      const value = $(`#gen-${name}`).value;
      if (value !== "") body[name] = Number(value);
    }
    if (chosenLoras().length) body.loras = chosenLoras();
    const bar = $("#gen-progress");
    const job = await api("POST", "/v1/images/jobs", body);
    state.job = job.id;
    progress(bar, 0, 0, "queued");
    const result = await followJob(job, (event, data) => {
      if (event === "queued") progress(bar, 0, 0, `queued: position ${data.position}`);
      else progress(bar, data.step, data.steps, `denoising: step ${data.step} of ${data.steps}`);
    });
    state.job = null;
    if (result.state !== "done") throw new ApiError(409, result.error ? result.error.code : result.state,
      result.error ? result.error.message : `the generate was ${result.state}`);
    progress(bar, 1, 1, `done in ${result.seconds} s`);
    addToGallery(result, body, $("#gen-model").selectedOptions[0].textContent);
  });
  go.disabled = false;
  $("#gen-cancel").hidden = true;
}

function addToGallery(job, body, model) {
  const gallery = $("#gallery");
  $(".muted", gallery)?.remove();
  job.images.forEach((b64, index) => {
    const url = `data:image/png;base64,${b64}`;
    const details = (size) => `${model}; ${size}, ${body.steps || "default"} steps, seed ${body.seed}, ` +
      `image ${index + 1} of ${job.images.length}; ${job.seconds} s`;
    const meta = el("div", { class: "muted", text: details("...") });
    const image = el("img", { src: url, alt: body.prompt,
      onload: () => { meta.textContent = details(`${image.naturalWidth}x${image.naturalHeight}`); } });
    gallery.prepend(el("figure", { class: "result" }, image, el("figcaption", {}, el("div", { text: body.prompt }), meta,
      el("a", { href: url, download: `image-seed${body.seed}-${index}.png`, text: "Download PNG" }))));
  });
}
