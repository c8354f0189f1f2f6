// diffusion-engine web page, part 4 of 7: the Datasets page (list, upload, caption, delete): images and clips.
// Captions are what a run trains with, written where the trainer reads them; a dataset a run is
// using refuses every change (409 dataset_in_use), shown with its code like any other error.
"use strict";

const THUMBNAIL_PX = 256;

function datasetPath(name, ...rest) {
  return [`/v1/datasets/${encodeURIComponent(name)}`, ...rest].join("/");
}

async function loadDatasets() {
  await guarded($("#datasets"), async () => {
    const datasets = await api("GET", "/v1/datasets");
    $("#ds-list").replaceChildren(...(datasets.length ? datasets.map((d) => el("li", {},
      el("button", { type: "button", "data-dataset": d.name, text: d.name, onclick: () => openDataset(d.name) }),
      " ", el("span", { class: "muted", text: `${mediaCount(d)}, ${d.captioned} captioned` }),
      d.in_use_by ? el("span", { class: "bad", text: ` in use by run ${d.in_use_by}` }) : null,
    )) : [el("li", { class: "muted", text: "none yet: create one below" })]));
    if (state.dataset) await openDataset(state.dataset);
  });
}

async function openDataset(name) {
  await guarded($("#datasets"), async () => {
    const dataset = await api("GET", datasetPath(name));
    state.dataset = name;
    $("#ds-view").hidden = false;
    $("#ds-name").textContent = name;
    const clips = dataset.images.filter((item) => item.kind === "clip").length;
    $("#ds-state").textContent = mediaCount({ images: dataset.count - clips, clips }) + (dataset.in_use_by
      ? `; run ${dataset.in_use_by} is training on it: changes wait until it has finished` : "");
    $("#ds-images").replaceChildren(...(dataset.images.length ? dataset.images.map((image) => imageCard(name, image))
      : [el("p", { class: "muted", text: "No images or clips yet: upload some above." })]));
  });
}

function imageCard(name, image) {
  const picture = el("img", { alt: image.image, width: 180 });
  if (!image.problem) {
    blobUrl(`${encodedPath(datasetPath(name, "thumbnails"), image.image)}?size=${THUMBNAIL_PX}`)
      .then((url) => { picture.src = url; })
      .catch((error) => showError($("#datasets"), error));
  }
  const caption = el("textarea", { rows: 3, "aria-label": `caption of ${image.image}` });
  caption.value = image.caption;
  const source = el("div", { class: "muted", text: image.caption_source ? `from ${image.caption_source}` : "no caption" });
  const save = el("button", { type: "button", text: "Save caption", onclick: () => guarded($("#datasets"), async () => {
    const saved = await api("PUT", encodedPath(datasetPath(name, "captions"), image.image), { caption: caption.value });
    source.textContent = saved.caption_source ? `saved to ${saved.caption_source}` : "caption cleared";
  }) });
  const remove = el("button", { type: "button", text: "Delete", onclick: () => guarded($("#datasets"), async () => {
    if (!confirm(`Delete ${image.image} and its caption?`)) return;
    await api("DELETE", encodedPath(datasetPath(name, "images"), image.image));
    await loadDatasets();
  }) });
  return el("figure", { "data-image": image.image }, picture,
    el("figcaption", {}, el("div", { text: `${image.image} (${image.width}x${image.height}`
      + (image.kind === "clip" ? `, a ${Number(image.seconds || 0).toFixed(1)} s clip)` : ")") }),
      image.problem ? el("div", { class: "bad", text: image.problem }) : null, caption, source,
      el("div", { class: "row" }, save, remove)));
}

async function newDataset(event) {
  event.preventDefault();
  const name = $("#ds-new-name").value.trim();
  state.dataset = name;
  $("#ds-view").hidden = false;
  $("#ds-name").textContent = name;
  $("#ds-state").textContent = "new: it is created with its first upload";
  $("#ds-images").replaceChildren(el("p", { class: "muted", text: "No images or clips yet: upload some above." }));
}

async function uploadImages(event) {
  event.preventDefault();
  await guarded($("#datasets"), async () => {
    const form = new FormData();
    for (const file of $("#ds-files").files) form.append("files", file, file.name);
    await api("POST", datasetPath(state.dataset, "images"), form);
    $("#ds-files").value = "";
    await loadDatasets();
  });
}
