// diffusion-engine web page, part 6 of 7: the gallery: every output the server kept, with its recipe;
// paged, pinned and deleted through /v1/gallery (files fetched with the token, as every route).
"use strict";

const KEPT_PAGE = 24;

async function loadKept(offset = 0) {
  const where = $("#kept");
  await guarded(where, async () => {
    const page = await api("GET", `/v1/gallery?offset=${offset}&limit=${KEPT_PAGE}`);
    const grid = $("#kept-grid");
    if (offset === 0) grid.replaceChildren();
    for (const entry of page.data) grid.append(await keptCard(entry));
    if (!page.total) grid.replaceChildren(el("p", { class: "muted", text: "Nothing kept yet: generate an image or a clip." }));
    const bound = page.max_bytes ? ` of ${(page.max_bytes / 2 ** 30).toFixed(1)} GiB` : "";
    $("#kept-summary").textContent = `${page.total} kept, ${(page.bytes / 2 ** 20).toFixed(2)} MiB${bound}; ` +
      "the oldest unpinned go first when the gallery is full.";
    const more = $("#kept-more");
    more.hidden = page.next_offset === null;
    more.onclick = () => loadKept(page.next_offset);
  });
}

async function keptCard(entry) {
  const recipe = entry.recipe || {};
  const video = entry.kind === "video";
  const src = await blobUrl(`/v1/gallery/${entry.id}/file${video ? "?variant=thumbnail" : ""}`);
  const what = video ? `clip, ${recipe.frames} frames at ${recipe.fps} fps` : "image";
  const figure = el("figure", { class: `kept${entry.pinned ? " pinned" : ""}`, "data-id": entry.id },
    el("img", { src, alt: recipe.prompt || entry.id }),
    el("figcaption", {},
      el("div", { text: recipe.prompt || "" }),
      el("div", { class: "muted", text: `${what}, ${entry.width}x${entry.height}, seed ${recipe.seed}, ` +
        `${recipe.steps} steps, ${recipe.checkpoint || recipe.family || ""}` }),
      el("details", {}, el("summary", { text: "Recipe" }), el("pre", { text: JSON.stringify(recipe, null, 1) }))));
  const pin = el("button", { type: "button", class: "pin", text: entry.pinned ? "Unpin" : "Pin" });
  pin.addEventListener("click", () => guarded($("#kept"), async () => {
    const changed = await api("POST", `/v1/gallery/${entry.id}/pin`, { pinned: !entry.pinned });
    figure.replaceWith(await keptCard(changed));
  }));
  const remove = el("button", { type: "button", class: "delete", text: "Delete" });
  remove.addEventListener("click", () => guarded($("#kept"), async () => {
    await api("DELETE", `/v1/gallery/${entry.id}`);
    await loadKept(0);  // the count and size with it
  }));
  const download = el("a", { href: "#", text: "Download" });
  download.addEventListener("click", (event) => guarded($("#kept"), async () => {
    event.preventDefault();
    const link = el("a", { href: await blobUrl(`/v1/gallery/${entry.id}/file`), download: `${entry.id}${video ? ".mp4" : ".png"}` });
    link.click();
  }));
  figure.append(el("div", { class: "row" }, pin, remove, download));
  return figure;
}
