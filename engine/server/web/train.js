// diffusion-engine web page, part 3 of 7: the Train and Run pages.
"use strict";

// -- Train -----------------------------------------------------------------------------------------

async function loadTrain() {
  const page = $("#train");
  await guarded(page, async () => {
    const found = await roots(true);
    fillSelect($("#train-base"), found.models.filter((m) => m.kind === "pipeline"), (m) => `${m.name} (${m.family || "unknown family"})`);
    fillSelect($("#train-dataset"), found.datasets, (d) => `${d.name} (${mediaCount(d)})`);
    const info = await latestTrainingInfo();
    if (info) { state.trainInfo = info; precisionChoices(); }
  });
}

/** What each family offers on the Device chosen (a CPU run offers what the CPU trains); with a
 * base chosen, its family sized from that base at the Resolution asked, as the run would be. */
function trainingInfo() {
  const query = new URLSearchParams({ device: $("#train-device").value });
  const base = $("#train-base").value;
  if (base) query.set("base_model", base);
  const resolution = Number($("#train-resolution").value);
  if (resolution) query.set("resolution", String(resolution));
  return api("GET", `/v1/training/info?${query}`);
}

/** trainingInfo, or null when a later question was asked before this answer came: answers
 * can arrive out of order, and the page must offer what the choices last made would get. */
async function latestTrainingInfo() {
  const asked = ++state.trainAsked;
  const info = await trainingInfo();
  return asked === state.trainAsked ? info : null;
}

/** The Device, base or Resolution changed: ask again what the run would be offered. */
async function trainingChoicesChanged() {
  await guarded($("#train"), async () => {
    const info = await latestTrainingInfo();
    if (!info) return;
    state.trainInfo = { ...(state.trainInfo || {}), ...info };
    precisionChoices();
  });
}

function precisionChoices() {
  const found = state.roots ? state.roots.models.find((m) => m.path === $("#train-base").value) : null;
  const info = found && state.trainInfo ? state.trainInfo[found.family] : null;
  const box = $("#train-precision");
  if (!info) { box.replaceChildren(el("p", { class: "muted", text: "pick a base model" })); return; }
  const offered = info.precision_modes.length ? info.precision_modes : (info.trainable ? ["auto"] : []);
  // auto where offered: the run then decides (and records) the mode itself; recommended_precision
  // is what auto resolves to, shown beside it, never pinned as if the user had asked for it.
  const chosen = offered.includes("auto") ? "auto" : (offered.includes(info.recommended_precision) ? info.recommended_precision : offered[0]);
  box.replaceChildren(el("p", { class: "muted", text: info.vram_note }),
    ...offered.map((mode) => el("label", { class: "mode" },
      el("input", { type: "radio", name: "precision", value: mode, checked: mode === chosen }),
      mode === "auto" && info.recommended_precision ? `auto (${info.recommended_precision} here)` : mode)),
    ...Object.entries(info.denied_modes || {}).map(([mode, reason]) => el("label", { class: "mode denied", title: reason },
      el("input", { type: "radio", name: "precision", value: mode, disabled: true }), el("span", { text: mode }),
      el("span", { class: "reason", text: reason }))));
}

function trainingBody() {
  const precision = $("input[name=precision]:checked");
  const body = { base_model: $("#train-base").value, dataset_dir: $("#train-dataset").value, steps: Number($("#train-steps").value),
    resolution: Number($("#train-resolution").value), lora_rank: Number($("#train-rank").value), device: $("#train-device").value,
    base_precision: precision ? precision.value : "auto" };
  const frames = Number($("#train-frames").value);
  if (frames) body.frames = frames;  // a clip window; left blank, the family's own
  const sample = $("#train-sample-prompt").value.trim();
  if (sample) Object.assign(body, { sample_prompts: [sample], sample_every: Number($("#train-sample-every").value),
    sample_steps: Number($("#train-sample-steps").value) });
  return body;
}

async function dryRun() {
  const box = $("#train-verdict");
  box.hidden = true;
  const plan = await api("POST", "/v1/training/plan", trainingBody());
  const estimate = (plan.memory && plan.memory.estimate) || {};
  const data = plan.dataset;
  box.replaceChildren(el("h2", { class: "ok", text: `Ready: ${plan.family} LoRA, ${plan.steps} steps on ${plan.device}` }),
    el("h3", { text: "Memory" }),
    table(["part", "value"], Object.entries(estimate).map(([k, v]) => [k, v])),
    el("h3", { text: "Dataset" }),
    el("p", { text: `${mediaCount(data)} in ${data.root}` + (data.window
      ? `; each clip trains as ${data.window.frames} frames at ${data.window.fps} fps` : "") }),
    data.warnings.length ? el("ul", {}, data.warnings.map((w) => el("li", { class: "muted", text: w }))) : el("p", { class: "muted", text: "no problems found" }),
    el("h3", { text: "Decisions" }), resolvedTable(plan.resolved));
  box.hidden = false;
  return plan;
}

async function startTraining(event) {
  event.preventDefault();
  const page = $("#train");
  $("#train-start").disabled = true;
  await guarded(page, async () => {
    $("#train-verdict").hidden = true;
    await dryRun();  // every check first: a doomed start is refused here, with nothing loaded or evicted
    const started = await api("POST", "/v1/training/start", trainingBody());
    state.run = started;
    state.viewing = null;
    showTab("run");
  });
  $("#train-start").disabled = false;
}

// -- Run -------------------------------------------------------------------------------------------

async function loadRun() {
  const page = $("#run");
  await guarded(page, async () => {
    const status = await api("GET", "/v1/training/status");
    if (status.run_id && !state.viewing) state.run = status;
    renderRun(state.viewing || state.run);
    await pastRuns();
    if (!state.viewing && state.run && !finished(state.run)) followRun();
  });
}

const finished = (run) => ["completed", "stopped", "cancelled", "failed"].includes(run.status);

/** Follow the run over the training event stream: each state or step event brings the full
 *  record (its metric history feeds the charts). Should the stream break, the status is polled. */
function followRun() {
  if (state.runStream) return;
  let busy = false;
  let again = false;
  const refresh = async () => {
    if (busy) { again = true; return; }
    busy = true;
    try {
      state.run = await api("GET", "/v1/training/status");
      if (!state.viewing) renderRun(state.run);
      if (finished(state.run)) { stopFollowing(); await pastRuns(); }
    } catch (error) { await showError($("#run"), error); }
    busy = false;
    if (again) { again = false; refresh(); }
  };
  const stream = new EventSource(streamUrl("/v1/training/events"));
  state.runStream = stream;
  stream.addEventListener("state", refresh);
  stream.addEventListener("step", refresh);
  stream.onerror = () => {
    stream.close();
    const poll = async () => {
      await refresh();
      if (state.runStream === stream && !finished(state.run)) setTimeout(poll, POLL_MS);
    };
    poll();
  };
}

function stopFollowing() {
  if (state.runStream) state.runStream.close();
  state.runStream = null;
}

function last(points) { return points && points.length ? points[points.length - 1][1] : null; }

function renderRun(run) {
  const live = run && !run.finished_at && !finished(run) && !state.viewing;
  $("#run-stop").disabled = !live;
  $("#run-stop-now").disabled = !live;
  if (!run || !run.run_id) {
    $("#run-id").textContent = "(none yet: start one on the Train page)";
    return;
  }
  $("#run-id").textContent = run.run_id;
  const rate = last(run.metrics.samples_per_s);
  const elapsed = run.started_at ? (run.finished_at || Date.now() / 1000) - run.started_at : null;
  const eta = live && run.step > 0 && elapsed ? ((elapsed / run.step) * (run.steps - run.step)).toFixed(0) + " s" : "-";
  facts($("#run-facts"), [["status", run.status], ["phase", run.phase || run.status], ["step", `${run.step} of ${run.steps}`],
    ["samples/s", rate], ["ETA", eta], ["peak memory", run.peak_memory_gb === null ? null : `${fmt(run.peak_memory_gb)} GB`],
    ["base", run.base_model], ...(run.error ? [["error", `${run.error.code}: ${run.error.message}`]] : [])]);
  $("#run-facts").dataset.status = run.status;
  showOutcome(run);
  progress($("#run-progress"), run.step, run.steps || 1, `${run.status}: step ${run.step} of ${run.steps}`);
  $("#run-charts").replaceChildren(...[["loss", "loss"], ["lr", "learning rate"], ["grad_norm", "grad norm (pre-clip)"]]
    .map(([name, title]) => chart(name, title, run.metrics[name] || [])));
  showSamples(run);
  if (finished(run) && state.filesFor !== `${run.run_id}:${run.status}`) showFiles(run);
}

/** How a finished run ended, in words and colour: "Training complete" in the success colour. */
function showOutcome(run) {
  const outcome = $("#run-outcome");
  const words = {
    completed: ["\u2714 Training complete", "ok done"],
    stopped: [`Stopped at step ${run.step} of ${run.steps}; the LoRA is saved`, "muted done"],
    cancelled: ["Cancelled; no LoRA was kept", "muted done"],
    failed: ["Training failed", "bad done"],
  }[run.status];
  outcome.hidden = !words;
  if (words) { outcome.textContent = words[0]; outcome.className = words[1]; }
}

/** A line chart of (step, value) points as inline SVG. */
function chart(name, title, points, width = 320, height = 140) {
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `${title}: ${points.length} points`);
  const pad = 28;
  if (points.length) {
    const xs = points.map((p) => p[0]);
    const ys = points.map((p) => p[1]);
    const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
    let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    const x = (v) => pad + ((v - x0) / (x1 - x0 || 1)) * (width - pad - 6);
    const y = (v) => height - 16 - ((v - y0) / (y1 - y0)) * (height - 26);
    const line = document.createElementNS(svgNS, "polyline");
    line.setAttribute("points", points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", "#2457c5");
    line.setAttribute("stroke-width", "1.5");
    svg.append(line);
    for (const [text, tx, ty, anchor] of [[fmt(y1), 2, 12, "start"], [fmt(y0), 2, height - 18, "start"],
      [`step ${x0}`, pad, height - 2, "start"], [`step ${x1}`, width - 4, height - 2, "end"]]) {
      const label = document.createElementNS(svgNS, "text");
      Object.entries({ x: tx, y: ty, "font-size": 10, fill: "#66707c", "text-anchor": anchor }).forEach(([k, v]) => label.setAttribute(k, v));
      label.textContent = text;
      svg.append(label);
    }
  }
  return el("div", { class: "chart", "data-metric": name, "data-points": String(points.length) },
    el("div", { class: "title", text: `${title} (${points.length ? fmt(points[points.length - 1][1]) : "no points yet"})` }), svg);
}

function relative(run, path) {
  const folder = run.folder.endsWith("/") ? run.folder : `${run.folder}/`;
  return path.startsWith(folder) ? path.slice(folder.length) : null;
}

async function showSamples(run) {
  const box = $("#run-samples");
  const shown = new Set([...box.querySelectorAll("figure")].map((f) => f.dataset.path));
  const wanted = (run.samples || []).map((s) => ({ ...s, rel: relative(run, String(s.path)) })).filter((s) => s.rel);
  if (!wanted.length) { box.replaceChildren(el("p", { class: "muted", text: finished(run) ? "none" : "none yet" })); return; }
  if (box.dataset.run !== run.run_id) { box.replaceChildren(); box.dataset.run = run.run_id; }
  $(".muted", box)?.remove();
  for (const sample of wanted.filter((s) => !shown.has(s.rel))) {
    const figure = el("figure", { "data-path": sample.rel }, el("img", { alt: sample.prompt || "sample" }),
      el("figcaption", { text: `step ${sample.step}: ${sample.prompt || ""}` }));
    box.append(figure);
    fileUrl(run.run_id, sample.rel).then((url) => { $("img", figure).src = url; }).catch((error) => showError($("#run"), error));
  }
}

async function showFiles(run) {
  state.filesFor = `${run.run_id}:${run.status}`;
  const list = $("#run-files");
  const files = await api("GET", `/v1/training/runs/${encodeURIComponent(run.run_id)}/files`);
  const lora = run.outputs && run.outputs.lora ? relative(run, run.outputs.lora) : null;
  list.replaceChildren(...files.map((file) => el("li", {}, el("a", {
    href: "#", class: file.path === lora ? "lora" : null, "data-file": file.path,
    onclick: (event) => download(event, run.run_id, file.path),
    text: file.path === lora ? `LoRA: ${file.path}` : file.path }), el("span", { class: "muted", text: ` ${file.bytes} bytes` }))));
  if (!files.length) list.append(el("li", { class: "muted", text: "no files" }));
}

async function download(event, runId, path) {
  event.preventDefault();
  await guarded($("#run"), async () => {
    const url = await fileUrl(runId, path);
    const link = el("a", { href: url, download: path.split("/").pop() });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  });
}

async function pastRuns() {
  const runs = await api("GET", "/v1/training/runs");
  $("#runs").replaceChildren(...runs.map((run) => el("li", { "data-run": run.run_id },
    el("strong", { text: run.run_id }), ` ${run.status}, step ${run.step} of ${run.steps} `,
    el("button", { type: "button", text: "View", onclick: () => { state.viewing = run; state.filesFor = null; renderRun(run); $("#run-files").scrollIntoView(); } }),
    chart("loss", "loss", run.metrics.loss || [], 320, 60))));
  if (!runs.length) $("#runs").append(el("li", { class: "muted", text: "no runs yet" }));
}

async function stopRun(now) {
  await guarded($("#run"), async () => {
    state.run = await api("POST", "/v1/training/stop", now ? { now: true } : {});
    renderRun(state.run);
    followRun();
  });
}
